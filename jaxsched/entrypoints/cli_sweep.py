"""`jaxsched trace generate` and `jaxsched sweep`: subcommands that cli.py registers, and
the sweep's result files (CSV, JSON, PNG plots) and markdown table.

    jaxsched trace generate -o trace.json --num-requests 500 --rate 0.5 --arrival bursty
    jaxsched sweep trace.json --num-device-blocks 64:1024:64 --max-num-seqs 8,16,32,64 \
        --preemption-mode recompute,swap,auto -o sweep-out/

Imports of jax, matplotlib and the scheduler happen inside functions, so `jaxsched --help`
stays fast.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Trace config flags of `trace generate`: (flag, type, help).
CONFIG_FLAGS = [("block_size", int, "tokens per KV block"),
                ("num_device_blocks", int, "KV blocks on the device"),
                ("num_host_blocks", int, "KV blocks of swap space"),
                ("max_num_seqs", int, "most sequences in a step"),
                ("max_num_batched_tokens", int, "most tokens in a step"),
                ("max_model_len", int, "longest sequence (lengths are clipped to it)"),
                ("delay_factor", float, "SPEC A7 delay factor"),
                ("watermark", float, "share of device blocks kept free"),
                ("step_time", float, "seconds per step"),
                ("max_steps", int, "replay gives up after this many steps")]
# Columns of the sweep's printed table.
TABLE_COLUMNS = ("steps", "preempted_recompute", "preempted_swap", "blocks_swapped_out",
                 "blocks_swapped_in", "ignored", "latency_mean", "latency_p99",
                 "peak_device_blocks_used", "peak_host_blocks_used", "seconds", "latency_mean_s",
                 "ttft_mean", "tpot_mean", "goodput", "good_per_s", "good_per_step")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def register(subparsers) -> None:
    """Add `trace generate` and `sweep` to the `jaxsched` subparsers."""
    trace = subparsers.add_parser("trace", help="make request traces",
                                  description="Make request traces for simulate and sweep.")
    generate = trace.add_subparsers(dest="trace_command", required=True).add_parser(
        "generate", help="write a synthetic trace (Poisson or bursty arrivals, log-normal lengths)")
    g = generate.add_argument
    g("-o", "--output", required=True, help="trace JSON to write")
    g("--num-requests", type=int, required=True, help="requests in the trace")
    g("--rate", type=float, required=True, help="requests per step")
    g("--arrival", choices=("poisson", "bursty"), default="poisson", help="arrival process")
    g("--burstiness", type=float, default=4.0, help="bursty: squared CV of the gaps (1 = Poisson)")
    g("--burst-size", type=int, default=1, help="bursty: requests arriving together")
    for kind, mu, sigma in (("prompt", 5.0, 0.8), ("output", 4.5, 0.6)):
        g(f"--{kind}-mu", type=float, help=f"mean of log({kind} length); None means {mu}")
        g(f"--{kind}-sigma", type=float, help=f"std of log({kind} length); None means {sigma}")
        g(f"--{kind}-lengths", metavar="FILE", help=f"fit the {kind} distribution to these lengths "
          "(a JSON list, or numbers separated by spaces, commas or newlines)")
    g("--n-share", type=float, default=0.2, help="share of requests with n > 1")
    g("--max-n", type=int, default=4, help="largest n of a request with n > 1")
    g("--seed", type=int, default=0, help="random seed of the trace")
    for name, kind, text in CONFIG_FLAGS:
        g(_flag(name), type=kind, help=f"config: {text}")
    g("--enable-chunked-prefill", action="store_true", default=None, help="config: chunked prefill")
    g("--preemption-mode", choices=("default", "auto", "recompute", "swap"),
      help="config: preemption mode (default: vLLM's; auto: by cost); None leaves it out")
    generate.set_defaults(func=cmd_trace_generate)

    sweep = subparsers.add_parser("sweep", help="replay a trace under a grid of limits in one compiled call")
    s = sweep.add_argument
    s("trace", help="trace JSON")
    s("--num-device-blocks", metavar="SPEC", help="e.g. 64:1024:64 (start:stop:step, inclusive) "
      "or 64,128,256; None keeps the trace's")
    s("--max-num-seqs", metavar="SPEC", help="e.g. 8,16,32,64; None keeps the trace's")
    s("--preemption-mode", metavar="SPEC", help="e.g. recompute,swap,auto,default "
      "(default: vLLM's mode); None keeps the trace's")
    s("--preemption-costs", metavar="FILE", help="cost model of mode auto (JSON from "
      "core.costs.PreemptionCosts.to_json, e.g. benchmarks/results/preemption_costs_cpu.json)")
    for name in ("num_host_blocks", "max_num_batched_tokens", "max_model_len", "watermark", "delay_factor"):
        s(_flag(name), metavar="SPEC", help=f"sweep axis {name}: a list a,b,c or a range "
          "start:stop:step; None keeps the trace's")
    s("--block-size", metavar="VALUE", help="static: one value overrides the trace's")
    s("--enable-chunked-prefill", metavar="true|false", help="static: one value overrides the trace's")
    s("--enable-prefix-caching", metavar="true|false[,...]",
      help="prefix caching (SPEC A10): one value overrides the trace's; false,true sweeps both "
           "(one compile each)")
    s("--capacity", metavar="K=V,...",
      help="static sizes, e.g. num_slots=256,num_device_blocks_capacity=1024")
    s("--step-cost", metavar="A,B,C,D", help="seconds per step = A + B*prefill_tokens + "
      "C*decode_seqs + D*swapped_blocks; adds seconds to the results")
    s("--vmap-runs", type=int,
      help="runs stepped together by jax.vmap (default: all on an accelerator, 1 on CPU)")
    s("--threads", type=int,
      help="host threads stepping the runs (on the map path each takes the next block of runs; "
           "vmapped, each its own shard) (default: one per CPU core on CPU, 1 on an accelerator)")
    s("--no-vmap-skips", action="store_true",
      help="a vmapped batch computes every branch for every run and masks it instead of skipping "
           "what no run needs (no conditionals; slower on the CPU and on an H200, see README)")
    s("--prune", action=argparse.BooleanOptionalAction, default=None,
      help="run each grid line's largest configuration first, not the configurations whose "
           "rows it gives exactly, and the rest from another run's state while its decisions are "
           "theirs; rows are the same either way (default: on CPU, when the first wave is at most "
           "half the grid)")
    s("--workers", action=argparse.BooleanOptionalAction, default=None,
      help="step the shards in worker processes, one pinned to each CPU, instead of threads "
           "(CPU, map path, Linux); rows are the same either way (default: threads, as fast "
           "or faster by measurement)")
    s("--half-slots", action=argparse.BooleanOptionalAction, default=None,
      help="step each run at half the request slots while that surely holds it, moving it "
           "between chunks (CPU map path, on threads or --workers); rows are the same either "
           "way. One more compiled chunk; with arrivals past the slots waiting outside them "
           "few run-steps fit half the slots (0.91-1.03x the runs' time by measurement; "
           "default: on only when the compilation cache holds the chunk)")
    s("--gpu-memory-utilization", metavar="SPEC", help="sweep axis in memory units, e.g. 0.5:0.9:0.1: "
      "the device's share that the weights, working memory and KV cache may use (needs --model)")
    s("--swap-space", metavar="SPEC", help="sweep axis, GiB of host swap per device, e.g. 1,4,16 (needs --model)")
    s("--model", help="the model whose memory turns the memory axes into block counts "
      "(smollm2-135m, a .gguf file, an HF directory or a Hub id); measured on this backend")
    s("--dtype", default="float32", choices=["float32", "bfloat16"], help="with --model: weights' dtype")
    s("--device-memory", type=float, metavar="GIB",
      help="with --model: plan for a device of this many GiB (default: this backend's memory)")
    s("--slo-ttft", type=float, metavar="S", help="time-to-first-token objective (seconds with "
      "--step-cost, else steps); adds goodput to each row")
    s("--slo-tpot", type=float, metavar="S", help="time-per-output-token objective (seconds with "
      "--step-cost, else steps)")
    s("--min-goodput", type=float, metavar="G", help="print the smallest configuration whose goodput "
      "is at least G (e.g. 0.99)")
    s("-o", "--output-dir", help="write sweep.csv, sweep.json and plots here")
    s("--no-progress", action="store_true", help="no progress bar")
    from jaxsched.entrypoints.cli import add_cache_arg
    add_cache_arg(sweep)
    sweep.set_defaults(func=cmd_sweep)


# ----------------------------------------------------------------------------- result files

def write_results(rows: list[dict], out_dir, prefix: str = "sweep") -> list:
    """Write rows as {prefix}.csv and {prefix}.json and plot them; returns the paths."""
    import csv

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(out / f"{prefix}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    (out / f"{prefix}.json").write_text(json.dumps(rows, indent=1))
    paths = [out / f"{prefix}.csv", out / f"{prefix}.json"] + plot_results(rows, out, prefix)
    if rows and rows[0].get("goodput") is not None:
        paths.append(plot_goodput(rows, out, prefix))
    return paths


def plot_goodput(rows: list[dict], out_dir, prefix: str = "sweep"):
    """{prefix}_goodput.png: goodput against memory (gpu_memory_utilization, else
    num_device_blocks), one line per max_num_seqs and preemption mode (and swap)."""
    from matplotlib.figure import Figure

    x = "gpu_memory_utilization" if "gpu_memory_utilization" in rows[0] else "num_device_blocks"
    swap = "swap_space" if "swap_space" in rows[0] else "num_host_blocks"
    other = [k for k in ("preemption_mode", "max_num_seqs", swap) if k in rows[0]]
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    keys = list(dict.fromkeys(tuple(r[k] for k in other) for r in rows))
    for i, key in enumerate(keys):
        line = sorted((r for r in rows if tuple(r[k] for k in other) == key), key=lambda r: r[x])
        ax.plot([r[x] for r in line], [r["goodput"] for r in line], marker="o", markersize=3,
                color=f"C{i % 10}", linestyle="-" if i < 10 else "--",
                label=", ".join(f"{k}={v}" for k, v in zip(other, key)) or "trace config")
    ax.set_xlabel(x)
    ax.set_ylabel("goodput (share of requests meeting the objectives)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    path = Path(out_dir) / f"{prefix}_goodput.png"
    fig.savefig(path, dpi=110)
    return path


def plot_results(rows: list[dict], out_dir, prefix: str = "sweep") -> list:
    """{prefix}_latency.png and {prefix}_preemptions.png: against num_device_blocks, one panel
    per preemption mode, one line per max_num_seqs (and any other swept field)."""
    from matplotlib.figure import Figure

    from jaxsched.sim.sweep import SWEEP_FIELDS

    seconds = rows and rows[0].get("latency_mean_s") is not None
    unit, sfx = ("s", "_s") if seconds else ("steps", "")
    modes = list(dict.fromkeys(r.get("preemption_mode", "trace") for r in rows))
    other = [k for k in SWEEP_FIELDS if k in rows[0] and k not in ("preemption_mode", "num_device_blocks")]
    paths = []
    latency = [(f"latency_mean{sfx}", "-", "mean"), (f"latency_p99{sfx}", "--", "p99")]
    for name, series in (("latency", latency), ("preemptions", [("num_preemptions", "-", None)])):
        fig = Figure(figsize=(5 * len(modes), 4), layout="constrained")
        axes = fig.subplots(1, len(modes), squeeze=False)[0]
        for ax, mode in zip(axes, modes):
            mine = [r for r in rows if r.get("preemption_mode", "trace") == mode]
            keys = list(dict.fromkeys(tuple(r[k] for k in other) for r in mine))
            for i, key in enumerate(keys):
                line = sorted((r for r in mine if tuple(r[k] for k in other) == key),
                              key=lambda r: r.get("num_device_blocks", 0))
                label = ", ".join(f"{k}={v}" for k, v in zip(other, key)) or "trace config"
                for col, style, what in series:
                    ax.plot([r.get("num_device_blocks", 0) for r in line],
                            [float("nan") if r[col] is None else r[col] for r in line], style,
                            color=f"C{i % 10}", marker="o", markersize=3,
                            label=f"{label} ({what})" if what else label)
            ax.set_title(f"preemption_mode={mode}")
            ax.set_xlabel("num_device_blocks")
            ax.set_ylabel(f"request latency ({unit})" if name == "latency" else "preemptions")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        path = Path(out_dir) / f"{prefix}_{name}.png"
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths


# ----------------------------------------------------------------------------- handlers

def _read_lengths(path: str) -> list[int]:
    text = Path(path).read_text()
    try:
        values = json.loads(text)
    except json.JSONDecodeError:
        values = text.replace(",", " ").split()
    try:
        return [int(float(v)) for v in values]
    except (TypeError, ValueError):
        raise ValueError(f"{path}: expected a list of lengths") from None


def _dist(args, kind: str, default):
    from jaxsched.sim.workload import LogNormal

    mu, sigma, path = (getattr(args, f"{kind}_{k}") for k in ("mu", "sigma", "lengths"))
    if path is not None:
        if mu is not None or sigma is not None:
            raise ValueError(f"--{kind}-lengths excludes --{kind}-mu/--{kind}-sigma")
        return _read_lengths(path)
    return LogNormal(default.mu if mu is None else mu, default.sigma if sigma is None else sigma)


def cmd_trace_generate(args) -> int:
    from jaxsched.sim.trace import TraceError
    from jaxsched.sim.workload import LogNormal, generate_trace

    config = {name: getattr(args, name) for name, _, _ in CONFIG_FLAGS if getattr(args, name) is not None}
    if args.enable_chunked_prefill:
        config["enable_chunked_prefill"] = True
    if args.preemption_mode is not None:
        # Trace files spell vLLM's default as null, as the goldens do.
        config["preemption_mode"] = None if args.preemption_mode == "default" else args.preemption_mode
    try:
        trace = generate_trace(args.num_requests, args.rate, arrival=args.arrival,
                               prompt=_dist(args, "prompt", LogNormal(5.0, 0.8)),
                               output=_dist(args, "output", LogNormal(4.5, 0.6)),
                               n_share=args.n_share, max_n=args.max_n, burstiness=args.burstiness,
                               burst_size=args.burst_size, seed=args.seed, config=config)
        Path(args.output).write_text(json.dumps(trace, indent=1))
    except (ValueError, TypeError, TraceError, OSError) as e:
        print(f"jaxsched trace generate: {e}", file=sys.stderr)
        return 2
    reqs = trace["requests"]
    mean = lambda k: sum(r[k] for r in reqs) / len(reqs)
    print(f"wrote {args.output}: {len(reqs)} requests over steps 0..{reqs[-1]['arrival_step']}, "
          f"mean prompt {mean('prompt_len'):.1f}, mean max_tokens {mean('max_tokens'):.1f}, "
          f"{sum(r['n'] > 1 for r in reqs)} with n > 1")
    return 0


def _key_values(spec: str, flag: str) -> dict:
    out = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not value.strip().isdigit():
            raise ValueError(f"{flag}: expected KEY=INTEGER items, got {item!r}")
        out[key.strip()] = int(value)
    return out


def markdown_table(rows: list[dict], columns) -> str:
    """Rows as a markdown table (numbers with up to 2 decimals)."""
    fmt = lambda v: "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---:" for _ in columns) + "|"]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _one_line(error: Exception) -> str:
    msg = str(error)
    return f"jaxsched {msg}" if msg.startswith("sweep:") else f"jaxsched sweep: {msg}"


def cmd_sweep(args) -> int:
    from jaxsched.sim.sweep import MEMORY_FIELDS, SWEEP_FIELDS, SweepError, pick_smallest, sweep
    from jaxsched.sim.trace import TraceError, load_trace
    from jaxsched.sim.workload import StepTimeModel

    axes = {f: getattr(args, f) for f in (*SWEEP_FIELDS, *MEMORY_FIELDS, "block_size", "enable_chunked_prefill",
                                          "enable_prefix_caching")
            if getattr(args, f, None) is not None}
    try:
        trace = load_trace(args.trace)
        capacity = _key_values(args.capacity, "--capacity") if args.capacity else None
        model = None
        if args.step_cost:
            parts = args.step_cost.split(",")
            if len(parts) != 4:
                raise ValueError(f"--step-cost: expected A,B,C,D, got {args.step_cost!r}")
            model = StepTimeModel(*(float(p) for p in parts))
        memory = None
        if args.model:
            from jaxsched.engine.sizing import GiB, profile_model
            memory = profile_model(args.model, dtype=args.dtype, device_memory_bytes=int(
                args.device_memory * GiB) if args.device_memory else None)
        elif args.device_memory is not None:
            raise ValueError("--device-memory: needs --model")
        if args.min_goodput is not None and args.slo_ttft is None and args.slo_tpot is None:
            raise ValueError("--min-goodput: needs --slo-ttft and/or --slo-tpot")
        from jaxsched.entrypoints.compilation_cache import enable_compilation_cache
        enable_compilation_cache(getattr(args, "compilation_cache_dir", None))
        stats: dict = {}
        rows = sweep(trace, capacity=capacity, step_time_model=model, vmap_runs=args.vmap_runs,
                     threads=args.threads, progress=not args.no_progress,
                     vmap_skips=False if args.no_vmap_skips else None,
                     prune=args.prune, workers=args.workers, half_slots=args.half_slots,
                     preemption_costs=args.preemption_costs, memory=memory,
                     slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot, stats=stats, **axes)
    except (SweepError, TraceError, ValueError) as e:
        print(_one_line(e), file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(_one_line(e), file=sys.stderr)
        return 1
    fields = ("enable_prefix_caching",) + SWEEP_FIELDS[:2] + MEMORY_FIELDS + SWEEP_FIELDS[2:]
    columns = [c for c in fields if c in rows[0]] + [c for c in TABLE_COLUMNS if c in rows[0]]
    saved = [f"{stats[k]} {what}" for k, what in (("pruned", "answered by another run"),
                                                   ("resumed", "resumed from another run's state"))
             if stats.get(k)]
    print(f"swept {args.trace}: {len(rows)} runs" + (f" ({'; '.join(saved)})" if saved else ""))
    # Time to stderr, apart from the results: compiling the chunk can outlast a small grid's runs.
    if "compile_s" in stats:
        count = stats.get("loaded", 0)
        loaded = (f" ({'the chunk' if count == 1 else f'{count} chunks'} loaded from the compilation cache)"
                  if count else "")
        half = (f", {stats['half_slot_run_steps'] / max(1, stats['live_run_steps']):.0%} of the run-steps "
                f"at half the slots" if stats.get("half_slots") else "")
        # Why a burst's sweep is as fast as a stream's: its requests did not each take a slot.
        window = (f", arrivals past the {stats['num_slots']} slots waiting outside them"
                  if stats.get("backlog") else "")
        print(f"sweep: compile {stats['compile_s']:.1f} s{loaded}, runs {stats['run_s']:.1f} s{half}{window}",
              file=sys.stderr)
    print(markdown_table(rows, columns))
    if args.min_goodput is not None:
        pick = pick_smallest(rows, args.min_goodput)
        if pick is None:
            best = max(r["goodput"] for r in rows)
            print(f"no configuration in the grid reaches goodput {args.min_goodput:g} (best {best:.3f})")
        else:
            where = ", ".join(f"{k}={pick[k]}" for k in fields if k in pick)
            print(f"smallest configuration with goodput >= {args.min_goodput:g}: {where} "
                  f"(goodput {pick['goodput']:.3f})")
    if args.output_dir:
        for path in write_results(rows, args.output_dir):
            print(f"wrote {path}")
    return 0
