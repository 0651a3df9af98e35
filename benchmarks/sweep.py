"""Capacity sweeps as the grid grows: cost per run-step of each sweep path, beside one run at a time.

    python benchmarks/sweep.py [--sizes 16,64,256,1024] [--paths map,map-all,vmap] [--sample 8]
                               [--simulate-sample 8] [--vmap-chunks 4] [--full-vmap-up-to 256]
                               [--results DIR] [--name NAME]

One synthetic 500-request trace (Poisson arrivals at 0.5 requests per step, log-normal
prompts of ~60 and outputs of ~25 tokens, 20% of requests with n in 2..4), swept over
{recompute, swap} x max_num_seqs {24, 32, 48, 64} x N/8 values of num_device_blocks from
128 (up to 240 for N <= 904, then in steps of 1), for every N of --sizes:

  python loop:   jaxsched.sim.reference's `simulate_reference`, one run per configuration;
                 --sample configurations (spread over the grid) timed, extrapolated to N
  simulate:      `jaxsched.sim.simulate` one configuration at a time, all sharing the sweep's
                 static capacity (one compile, listed apart); --sample of them timed
  sweep map:     `jaxsched.sim.sweep`, the map path (a loop over the live runs), one shard per
                 CPU core on host threads (the CPU default), pruned: configurations whose rows
                 a run of a larger one gives exactly are not run, and runs resume from the
                 state of an earlier run while its decisions are theirs (sim/sweep_prune.py;
                 `timed` says how many);
                 cost per run-step is over the whole grid's run-steps, as for every path
  no pruning:    the same, every configuration run to the end (--paths map-all); its rows
                 must equal the pruned sweep's
  worker procs:  the pruned map sweep with its shards stepped by worker processes pinned to
                 one CPU each instead of threads (`sweep(workers=True)`, on request;
                 --paths map-workers); the workers start once, before the
                 timings, and each sweep ships its compiled chunk to them (timed); a fresh
                 process's start-up is in the end-to-end table
  sweep vmap:    `jax.vmap` over all runs of a shard (vmap_runs=N), drained runs compacted
                 away; skips decided once for the batch (`skips`) or none at all, every branch
                 masked (`no skips`: --paths vmap-noskip; `vmap` takes the backend's default);
                 every run to the end up to --full-vmap-up-to configurations, above that the
                 first --vmap-chunks chunks timed and extrapolated to the map path's run-steps
Compile time (tracing and XLA) is the sweep's own `stats['compile_s']`, apart from the wall
time of the runs. A second table starts fresh processes on the 64-configuration map sweep with
the persistent compilation cache (as `jaxsched sweep` has it) in an empty directory: the first
start compiles, a second start of the same grid, a start of another grid of the same
capacity, one of the 16-configuration grid and one of another trace (NEARBY: 470 requests,
padded to the same request axis) load the executable from disk. Run-steps are the steps
each run takes to drain, summed over the grid.
Every timed python-loop and simulate run is checked against the sweep's row for its
configuration (steps and preemptions). Results go to benchmarks/results/sweep.{json,md} and
the plot of cost per run-step against grid size to sweep_scaling.png; the rows of the
64-configuration grid to sweep_{latency,preemptions}.png. On an accelerator the same script
runs as is (the sweep's defaults become one vmap over all runs on one thread), its files
named sweep_gpu.* (sweep_BACKEND.*) beside the CPU's; `benchmarks/gpu_checks.sh` is that
run as one script, with the command line it was made with.
"""

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

from jaxsched.entrypoints.xla_flags import SWEEP_GPU_FLAGS, use_xla_flags  # noqa: E402
use_xla_flags(*SWEEP_GPU_FLAGS)      # as `jaxsched sweep`

import jax  # noqa: E402

from jaxsched import simulate  # noqa: E402
from jaxsched.entrypoints.cli_sweep import markdown_table, plot_results  # noqa: E402
from jaxsched.sim import sweep_workers  # noqa: E402
from jaxsched.sim.reference import simulate_reference  # noqa: E402
from jaxsched.sim.sweep import (CHUNK_STEPS, default_threads, default_vmap_skips, make_grid,
                                parse_values, sweep, sweep_capacity)  # noqa: E402
from jaxsched.sim.trace import parse_trace  # noqa: E402
from jaxsched.sim.workload import LogNormal, generate_trace  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
TRACE = dict(num_requests=500, rate=0.5, prompt=LogNormal(4.0, 0.6), output=LogNormal(3.2, 0.6),
             n_share=0.2, max_n=4, seed=0,
             config=dict(block_size=16, num_device_blocks=256, num_host_blocks=128, max_num_seqs=32,
                         max_num_batched_tokens=512, max_model_len=512, watermark=0.01))
SWEPT = ("preemption_mode", "max_num_seqs", "num_device_blocks")
# Another trace of the same workload whose request count (470) and longest sequence (20
# blocks) round to TRACE's capacity (capacity.bucket): a fresh start of its sweep loads
# TRACE's executable (compile_starts).
NEARBY = dict(TRACE, num_requests=470, seed=6)


def grid(size: int) -> dict:
    """`size` configurations: 2 modes x 4 max_num_seqs x size/8 device block counts."""
    if size % 8:
        raise SystemExit(f"--sizes: {size} is not a multiple of 8")
    nb = size // 8
    step = max(1, 112 // max(1, nb - 1))
    blocks = [128 + i * step for i in range(nb)]
    return dict(preemption_mode="recompute,swap", max_num_seqs="24,32,48,64",
                num_device_blocks=",".join(map(str, blocks)))


def config_of(trace: dict, row: dict) -> dict:
    return dict(trace["config"], **{k: row[k] for k in SWEPT})


def check(row: dict, result: dict, who: str) -> None:
    modes = {"recompute": 0, "swap": 0}
    for step in result["steps"]:
        for p in step["preempted"]:
            modes[p["mode"]] += 1
    got = (len(result["steps"]), modes["recompute"], modes["swap"])
    want = (row["steps"], row["preempted_recompute"], row["preempted_swap"])
    if got != want:
        raise AssertionError(f"{who} disagrees with the sweep at {row}: {got} != {want}")


def entry(size, method, run_s, compile_s, run_steps, note):
    return dict(configs=size, method=method, wall_s=run_s, compile_s=compile_s, run_steps=run_steps,
                run_steps_per_s=run_steps / run_s, us_per_run_step=run_s / run_steps * 1e6, timed=note)


def time_sweep(trace, axes, vmap_runs, threads, max_steps=None, vmap_skips=None, prune=None, workers=False):
    stats = {}
    if max_steps is not None:
        trace = dict(trace, config=dict(trace["config"], max_steps=max_steps))
    try:
        rows = sweep(trace, **axes, vmap_runs=vmap_runs, threads=threads, progress=False, stats=stats,
                     vmap_skips=vmap_skips, prune=prune, workers=workers)
    except RuntimeError:
        if max_steps is None:
            raise
        rows = None
    return rows, stats


# vmap paths: (threads: all cores or one, skips: None for the backend's default)
VMAP_PATHS = {"vmap": ("one", None), "vmap-threads": ("all", None), "vmap-skip": ("one", True),
              "vmap-noskip": ("one", False)}


def one_size(trace, size, paths, sample, vmap_chunks, full_vmap_up_to, simulate_sample):
    axes = grid(size)
    threads = default_threads()
    out, rows = [], None
    if "map" in paths or jax.default_backend() == "cpu":
        rows, st = time_sweep(trace, axes, 1, threads)
        if "map" in paths:
            ran = (f"{size - st['pruned']} of {size} configurations run, {st['resumed']} resumed "
                   f"({st['skipped_steps']} steps not made)" if st["prune"] else "all runs")
            out.append(entry(size, f"sweep map, {threads} threads", st["run_s"], st["compile_s"],
                             st["run_steps"], ran))
    if "map-workers" in paths and jax.default_backend() == "cpu" and threads > 1 and sweep_workers.available():
        sweep_workers.start_pool(threads)       # once, untimed: see fresh_starts for a cold start
        wrows, st = time_sweep(trace, axes, 1, threads, workers=True)
        assert rows is None or wrows == rows, "worker processes changed a row"
        rows = rows or wrows
        ran = (f"{size - st['pruned']} of {size} configurations run, {st['resumed']} resumed"
               if st["prune"] else "all runs")
        out.append(entry(size, f"sweep map, {threads} worker processes", st["run_s"], st["compile_s"],
                         st["run_steps"], ran + "; the chunk shipped to the workers included"))
    if "map-all" in paths:
        every, st = time_sweep(trace, axes, 1, threads, prune=False)
        assert rows is None or every == rows, "pruning changed a row"
        rows = rows or every
        out.append(entry(size, f"sweep map, {threads} threads, no pruning", st["run_s"], st["compile_s"],
                         st["run_steps"], "all runs"))
    for path in [p for p in VMAP_PATHS if p in paths]:
        which, skips = VMAP_PATHS[path]
        vmap_threads = threads if which == "all" else 1
        skips = default_vmap_skips() if skips is None else skips
        method = f"sweep vmap, {'skips' if skips else 'no skips'}, {vmap_threads} thread(s)"
        if size <= full_vmap_up_to or rows is None:
            vrows, st = time_sweep(trace, axes, size, vmap_threads, vmap_skips=skips)
            if rows is not None:
                assert [{k: r[k] for k in SWEPT + ("steps", "num_preemptions")} for r in vrows] == \
                    [{k: r[k] for k in SWEPT + ("steps", "num_preemptions")} for r in rows]
            rows = rows or vrows
            out.append(entry(size, method, st["run_s"], st["compile_s"],
                             st["run_steps"], f"all runs, batch {st['shard_sizes']} per shard"))
        else:
            _, st = time_sweep(trace, axes, size, vmap_threads, max_steps=vmap_chunks * CHUNK_STEPS,
                               vmap_skips=skips)
            steps = sum(r["steps"] for r in rows)
            per = st["run_s"] / (size * vmap_chunks * CHUNK_STEPS)
            out.append(entry(size, method, per * steps, st["compile_s"],
                             steps, f"{vmap_chunks} of {-(-max(r['steps'] for r in rows) // CHUNK_STEPS)} "
                                    f"chunks timed, extrapolated"))
    run_steps = sum(r["steps"] for r in rows)
    picks = sorted({round(i * size / sample) for i in range(min(sample, size))})
    ref_t, ref_steps = 0.0, 0
    for i in picks:
        t0 = time.perf_counter()
        result = simulate_reference(json.loads(json.dumps({**trace, "config": config_of(trace, rows[i])})))
        ref_t += time.perf_counter() - t0
        ref_steps += rows[i]["steps"]
        check(rows[i], result, "the python loop")
    note = "all runs" if len(picks) == size else f"{len(picks)} of {size} runs timed, extrapolated"
    out.insert(0, entry(size, "python loop (reference)", ref_t / ref_steps * run_steps, None, run_steps, note))
    if simulate_sample:
        out.insert(1, time_simulate(trace, axes, rows, picks[:simulate_sample], size, run_steps))
    for e in out:
        e["speedup_vs_python"] = out[0]["wall_s"] / e["wall_s"]
    return out, rows


def time_simulate(trace, axes, rows, picks, size, run_steps):
    """`simulate` one configuration at a time (one compile, shared capacity), checked and extrapolated."""
    note = "all runs, one compile" if len(picks) == size else f"{len(picks)} of {size} runs timed, extrapolated"
    parsed = parse_trace(trace)
    _, configs = make_grid(parsed.scheduler_config, {k: parse_values(k, v) for k, v in axes.items()})
    capacity = sweep_capacity(parsed, configs)
    t0 = time.perf_counter()
    simulate(config_of(trace, rows[picks[0]]), trace["requests"], capacity=capacity)   # compiles
    first = time.perf_counter() - t0
    sim_t, sim_steps = 0.0, 0
    for i in picks:
        t0 = time.perf_counter()
        result = simulate(config_of(trace, rows[i]), trace["requests"], capacity=capacity)
        sim_t += time.perf_counter() - t0
        sim_steps += rows[i]["steps"]
        check(rows[i], result, "simulate")
    return entry(size, "simulate, one run at a time", sim_t / sim_steps * run_steps,
                 max(0.0, first - sim_t / len(picks)), run_steps, note)


# Runs in a fresh process: argv is trace.json, axes (JSON), cache directory.
START = r"""
import json, sys
from jaxsched.entrypoints.xla_flags import use_xla_flags
use_xla_flags()
from jaxsched.entrypoints.compilation_cache import enable_compilation_cache
from jaxsched.sim.sweep import default_threads, sweep
enable_compilation_cache(sys.argv[3])
stats = {}
sweep(json.load(open(sys.argv[1])), **json.loads(sys.argv[2]), vmap_runs=1, threads=default_threads(),
      progress=False, stats=stats, **json.loads(sys.argv[4]) if len(sys.argv) > 4 else {})
print(json.dumps(dict(compile_s=stats["compile_s"], run_s=stats["run_s"], wall_s=stats["wall_s"])))
"""


def fresh_starts(trace, sizes) -> list:
    """Threads against worker processes in fresh processes, end to end (start-up included),
    the persistent cache warm (filled by a first process, not timed)."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "trace.json"
        path.write_text(json.dumps(trace))
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        for size in sizes:
            for i, workers in enumerate((None, False, True)):
                t0 = time.perf_counter()
                got = subprocess.run([sys.executable, "-c", START, str(path), json.dumps(grid(size)),
                                      str(pathlib.Path(tmp) / "xla"), json.dumps(dict(workers=workers))],
                                     env=env, check=True, capture_output=True, text=True)
                if i:
                    r = json.loads(got.stdout.strip().splitlines()[-1])
                    out.append(dict(configs=size, shards_on="worker processes" if workers else "threads",
                                    process_s=time.perf_counter() - t0, sweep_s=r["wall_s"],
                                    compile_s=r["compile_s"], run_s=r["run_s"]))
    return out


def compile_starts(trace, size: int = 64) -> list:
    """Compile time of fresh processes sharing one persistent cache (an empty one at first)."""
    axes = grid(size)
    other = dict(axes, num_device_blocks=",".join(str(int(b) + 1) for b in axes["num_device_blocks"].split(",")))
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        path, nearby = pathlib.Path(tmp) / "trace.json", pathlib.Path(tmp) / "nearby.json"
        path.write_text(json.dumps(trace))
        nearby.write_text(json.dumps(generate_trace(**NEARBY)))
        for start, ax, n, where in (("first start, empty cache", axes, size, path),
                                    ("second start, same grid", axes, size, path),
                                    ("another grid of the same capacity", other, size, path),
                                    ("a smaller grid of the same capacity", grid(16), 16, path),
                                    (f"another trace ({NEARBY['num_requests']} requests), same grid",
                                     axes, size, nearby)):
            env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
            got = subprocess.run([sys.executable, "-c", START, str(where), json.dumps(ax),
                                  str(pathlib.Path(tmp) / "xla")],
                                 env=env, check=True, capture_output=True, text=True)
            out.append(dict(configs=n, start=start, **json.loads(got.stdout.strip().splitlines()[-1])))
    return out


def plot(table, path, backend):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    for i, method in enumerate(dict.fromkeys(t["method"] for t in table)):
        pts = sorted((t for t in table if t["method"] == method), key=lambda t: t["configs"])
        ax.plot([t["configs"] for t in pts], [t["us_per_run_step"] for t in pts], marker="o",
                color=f"C{i}", label=method)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("configurations in the grid")
    ax.set_ylabel("wall time per run-step (us), compile apart")
    ax.set_title(f"Capacity sweep, {TRACE['num_requests']}-request trace ({backend})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="16,64,256,1024", help="grid sizes (multiples of 8)")
    ap.add_argument("--paths", default="map,map-workers,map-all,vmap",
                    help="sweep paths: map (pruned, on threads), map-workers (pruned, on worker processes), "
                         "map-all (every configuration run), "
                         "vmap (one thread), vmap-threads (vmap, a shard per core), "
                         "vmap-skip and vmap-noskip (one thread, skips forced on or off)")
    ap.add_argument("--sample", type=int, default=8, help="python-loop and simulate runs timed per size")
    ap.add_argument("--simulate-sample", type=int, default=None,
                    help="simulate runs timed per size (default: --sample; 0 leaves simulate out)")
    ap.add_argument("--results", default=str(RESULTS), help="directory for the tables and plots")
    ap.add_argument("--name", default=None,
                    help="file name of the results (default: sweep on the CPU, sweep_BACKEND elsewhere)")
    ap.add_argument("--vmap-chunks", type=int, default=4, help="chunks timed where vmap is extrapolated")
    ap.add_argument("--full-vmap-up-to", type=int, default=256,
                    help="largest grid whose vmapped sweep runs to the end")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    paths = set(args.paths.split(","))
    load_before = os.getloadavg()[0]
    t_start = time.perf_counter()
    trace = generate_trace(**TRACE)
    table, rows64 = [], None
    for size in sizes:
        part, rows = one_size(trace, size, paths, args.sample, args.vmap_chunks, args.full_vmap_up_to,
                              args.sample if args.simulate_sample is None else args.simulate_sample)
        table += part
        if size == 64:
            rows64 = rows
        print(markdown_table(part, list(part[0])), flush=True)
    starts = compile_starts(trace) if 64 in sizes and "map" in paths else []
    if starts:
        print(markdown_table(starts, list(starts[0])), flush=True)
    fresh = (fresh_starts(trace, [s for s in sizes if s >= 256]) if "map-workers" in paths
             and jax.default_backend() == "cpu" and sweep_workers.available() else [])
    if fresh:
        print(markdown_table(fresh, list(fresh[0])), flush=True)
    env = dict(backend=jax.default_backend(), device=jax.devices()[0].device_kind, jax=jax.__version__,
               machine=platform.machine(),
               cpus=os.cpu_count(), threads=default_threads(), load_before=load_before,
               load_after=os.getloadavg()[0], total_s=time.perf_counter() - t_start)
    columns = ["configs", "method", "wall_s", "compile_s", "run_steps", "run_steps_per_s",
               "us_per_run_step", "speedup_vs_python", "timed"]
    sweeps = [t for t in table if t["method"].startswith("sweep")]
    lines = [f"# Capacity sweep scaling: {args.sizes} configurations, {TRACE['num_requests']} requests "
             f"({env['backend']}: {env['device']}; {env['machine']}, {env['cpus']} CPUs; jax {env['jax']})", "",
             f"Trace: Poisson arrivals at {TRACE['rate']} requests/step, prompts LogNormal(4.0, 0.6), "
             f"outputs LogNormal(3.2, 0.6), n_share 0.2; grids of 2 preemption modes x max_num_seqs "
             f"24/32/48/64 x N/8 num_device_blocks from 128. wall_s excludes compiles (compile_s, "
             f"the sweep's stats); `timed` says what was extrapolated. 1-minute load average "
             f"{env['load_before']:.1f} before, {env['load_after']:.1f} after; {env['total_s']:.0f} s in all.",
             "", markdown_table(table, columns), ""]
    by = {(t["configs"], t["method"]): t for t in table}
    for method in dict.fromkeys(t["method"] for t in sweeps):
        have = [s for s in sorted(sizes) if (s, method) in by]
        if len(have) > 1:
            lo, hi = by[(have[0], method)], by[(have[-1], method)]
            lines.append(f"- {method}: cost per run-step at {have[-1]} is "
                         f"{hi['us_per_run_step'] / lo['us_per_run_step']:.2f}x that at {have[0]} "
                         f"(target <= 0.2x from 16 to 1024).")
    for t in sweeps:
        if t["configs"] == 64:
            lines.append(f"- {t['method']} at 64: {t['speedup_vs_python']:.2f}x the python loop, "
                         f"compile apart (target >= 5x); compile {t['compile_s']:.1f} s (target < 5 s).")
        if t["configs"] == 1024 and env["backend"] != "cpu":
            lines.append(f"- {t['method']} at 1024: {t['speedup_vs_python']:.1f}x the python loop, "
                         f"compile apart (target >= 100x on an accelerator).")
    lines.append("")
    if starts:
        lines += ["## Compile time across starts (map sweep, persistent compilation cache)", "",
                  "Fresh processes, one shared cache directory, empty before the first; compile_s is the "
                  "sweep's (tracing, lowering and XLA, or loading the chunk from the executable store).", "",
                  markdown_table(starts, list(starts[0])), ""]
    if fresh:
        lines += ["## Threads or worker processes, end to end (fresh processes, warm persistent cache)", "",
                  "Each a fresh process running the pruned map sweep once: process_s from its start to its "
                  "exit, sweep_s the sweep's wall (worker start-up is in run_s).", "",
                  markdown_table(fresh, list(fresh[0])), ""]
    if rows64:
        lines += ["## The 64-configuration grid, per configuration", "",
                  markdown_table(rows64, list(rows64[0])), ""]
    results = pathlib.Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    name = args.name or ("sweep" if env["backend"] == "cpu" else f"sweep_{env['backend']}")
    (results / f"{name}.md").write_text("\n".join(lines))
    trace_params = {k: dataclasses.asdict(v) if isinstance(v, LogNormal) else v for k, v in TRACE.items()}
    (results / f"{name}.json").write_text(json.dumps(
        dict(trace=trace_params, sizes=sizes, environment=env, methods=table, compile_starts=starts,
             fresh_starts=fresh, rows_64=rows64), indent=1))
    plot(table, results / f"{name}_scaling.png", f"{env['backend']}: {env['device']}")
    if rows64 and name == "sweep":
        plot_results(rows64, results, "sweep")
    print("\n".join(lines[:len(lines)]))
    print(f"wrote {results}/{name}.md, {name}.json, {name}_scaling.png")


if __name__ == "__main__":
    main()
