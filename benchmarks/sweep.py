"""A 64-configuration capacity sweep in one compiled call, against 64 sequential replays.

    python benchmarks/sweep.py [--reference-runs 64] [--simulate-runs 8] [--vmap-chunks 4]

One synthetic 500-request trace (Poisson arrivals at 0.5 requests per step, log-normal
prompts of ~60 and outputs of ~25 tokens, 20% of requests with n in 2..4), swept over
num_device_blocks 128..240 (step 16) x max_num_seqs {24, 32, 48, 64} x {recompute, swap}:

  reference:        jaxsched/reference.py's `simulate_reference`, one run per config
  simulate:         `jaxsched.sim.simulate` per config, all sharing the sweep's static capacity
                    (one compile, timed apart); --simulate-runs of them timed, extrapolated
  sweep (loop):     `jaxsched.sim.sweep`, all 64 runs in one jitted call per chunk of steps, a
                    `lax.map` over runs (the CPU default, vmap_runs=1); once with one shard
                    of runs per CPU core on host threads (the CPU default), once on one thread
  sweep (vmap):     the same with one `jax.vmap` over all 64 runs (vmap_runs=64); its cost
                    per chunk does not depend on what the runs do (every lax.cond is a
                    select under vmap), so --vmap-chunks chunks are timed and extrapolated

Compile time is measured with a warm-up sweep that stops after one chunk (max_steps = one
chunk) and is reported apart from the warm time. Every timed `simulate` and reference run is
checked against the sweep's row for its configuration (steps and preemptions).
Results go to benchmarks/results/sweep.{json,md} and the plots to sweep_{latency,preemptions}.png.
"""

import argparse
import copy
import dataclasses
import json
import math
import os
import pathlib
import platform
import time

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_enable_concurrency_optimized_scheduler=false")

import jax  # noqa: E402

from jaxsched import simulate  # noqa: E402
from jaxsched.entrypoints.cli_sweep import markdown_table, plot_results  # noqa: E402
from jaxsched.sim.sweep import (CHUNK_STEPS, default_threads, make_grid, parse_values, sweep,
                             sweep_capacity)  # noqa: E402
from jaxsched.sim.trace import parse_trace  # noqa: E402
from jaxsched.sim.workload import LogNormal, generate_trace  # noqa: E402

from jaxsched.sim.reference import simulate_reference  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
TRACE = dict(num_requests=500, rate=0.5, prompt=LogNormal(4.0, 0.6), output=LogNormal(3.2, 0.6),
             n_share=0.2, max_n=4, seed=0,
             config=dict(block_size=16, num_device_blocks=256, num_host_blocks=128, max_num_seqs=32,
                         max_num_batched_tokens=512, max_model_len=512, watermark=0.01))
GRID = dict(preemption_mode="recompute,swap", max_num_seqs="24,32,48,64", num_device_blocks="128:240:16")
TARGET = 100


def timed_sweep(trace: dict, vmap_runs: int, threads: int, max_steps: int | None = None):
    """(seconds, rows); rows is None when the run stopped at `max_steps` on purpose."""
    if max_steps is not None:
        trace = copy.deepcopy(trace)
        trace["config"]["max_steps"] = max_steps
    t0 = time.perf_counter()
    try:
        rows = sweep(trace, **GRID, vmap_runs=vmap_runs, threads=threads, progress=False)
    except RuntimeError:
        rows = None
    return time.perf_counter() - t0, rows


def config_of(trace: dict, row: dict) -> dict:
    swept = ("preemption_mode", "max_num_seqs", "num_device_blocks")
    return dict(trace["config"], **{k: row[k] for k in swept})


def check(row: dict, result: dict, who: str) -> None:
    modes = {"recompute": 0, "swap": 0}
    for step in result["steps"]:
        for p in step["preempted"]:
            modes[p["mode"]] += 1
    got = (len(result["steps"]), modes["recompute"], modes["swap"])
    want = (row["steps"], row["preempted_recompute"], row["preempted_swap"])
    if got != want:
        raise AssertionError(f"{who} disagrees with the sweep at {row}: {got} != {want}")


def time_sweeps(trace: dict, runs: int, vmap_chunks: int):
    """Rows of the looped sweep, and (wall, compile, what was timed) of the sweep paths."""
    threads = default_threads()
    compile_loop, _ = timed_sweep(trace, 1, threads, max_steps=CHUNK_STEPS)
    loop_s, rows = timed_sweep(trace, 1, threads)
    chunks = math.ceil(max(r["steps"] for r in rows) / CHUNK_STEPS)
    timed_sweep(trace, 1, 1, max_steps=CHUNK_STEPS)    # other shard shape: its own compile
    one_s, one_rows = timed_sweep(trace, 1, 1)
    assert one_rows == rows, "the sweep's rows depend on its thread count"
    first_vmap, _ = timed_sweep(trace, runs, 1, max_steps=CHUNK_STEPS)
    part_vmap, _ = timed_sweep(trace, runs, 1, max_steps=CHUNK_STEPS * vmap_chunks)
    per_chunk = part_vmap / vmap_chunks
    return rows, [
        (f"jaxsched.sim.sweep, lax.map over runs, {threads} threads (CPU default)", loop_s,
         compile_loop - loop_s / chunks, f"all {runs} runs, {chunks} chunks"),
        ("jaxsched.sim.sweep, lax.map over runs, 1 thread", one_s, None, f"all {runs} runs, {chunks} chunks"),
        (f"jaxsched.sim.sweep, one jax.vmap over {runs} runs", per_chunk * chunks, first_vmap - per_chunk,
         f"{vmap_chunks} of {chunks} chunks timed"),
    ]


def time_sequential(trace: dict, rows: list[dict], capacity: dict, reference_runs: int, simulate_runs: int):
    """(wall, compile, what was timed) of the reference and of simulate, one run per config."""
    runs = len(rows)
    picks = lambda n: [round(i * runs / n) for i in range(min(n, runs))]   # spread over the grid
    ref_times = []
    for i in picks(reference_runs):
        t0 = time.perf_counter()
        result = simulate_reference(json.loads(json.dumps({**trace, "config": config_of(trace, rows[i])})))
        ref_times.append(time.perf_counter() - t0)
        check(rows[i], result, "the reference")
    sim_times = []
    for i in [0] + picks(simulate_runs):                  # the first run compiles
        t0 = time.perf_counter()
        result = simulate(config_of(trace, rows[i]), trace["requests"], capacity=capacity)
        sim_times.append(time.perf_counter() - t0)
        check(rows[i], result, "simulate")
    mean = lambda xs: sum(xs) / len(xs)
    return [
        ("Python reference, sequential", mean(ref_times) * runs, None,
         f"{len(ref_times)} of {runs} runs timed"),
        ("jaxsched.sim.simulate, sequential", mean(sim_times[1:]) * runs, sim_times[0] - sim_times[1],
         f"{len(sim_times) - 1} of {runs} runs timed, one shared compile"),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reference-runs", type=int, default=64, help="reference runs to time (extrapolated)")
    ap.add_argument("--simulate-runs", type=int, default=8, help="simulate runs to time (extrapolated)")
    ap.add_argument("--vmap-chunks", type=int, default=4, help="chunks of the vmapped sweep to time")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    trace = generate_trace(**TRACE)
    parsed = parse_trace(trace)
    _, configs = make_grid(parsed.scheduler_config, {k: parse_values(k, v) for k, v in GRID.items()})
    capacity = sweep_capacity(parsed, configs)
    runs = len(configs)

    rows, sweeps = time_sweeps(trace, runs, args.vmap_chunks)
    sequential = time_sequential(trace, rows, capacity, args.reference_runs, args.simulate_runs)
    ref_s = sequential[0][1]
    table = [dict(method=m, wall_s=w, per_config_ms=w / runs * 1e3, compile_s=c,
                  speedup_vs_reference=ref_s / w, timed=note) for m, w, c, note in sequential + sweeps]
    env = dict(backend=jax.default_backend(), jax=jax.__version__, machine=platform.machine(),
               cpus=os.cpu_count(), threads=default_threads(), load_before=load_before,
               load_after=os.getloadavg()[0])
    columns = ["method", "wall_s", "per_config_ms", "compile_s", "speedup_vs_reference", "timed"]
    best = max(t["speedup_vs_reference"] for t in table[2:])
    steps = [r["steps"] for r in rows]
    run_steps = sum(steps)
    fastest = min(t["wall_s"] for t in table[2:])
    md = "\n".join([
        f"# Capacity sweep: {runs} configurations, {TRACE['num_requests']} requests "
        f"({env['backend']}, {env['machine']}, {env['cpus']} CPUs)", "",
        f"Trace: Poisson arrivals at {TRACE['rate']} requests/step, prompts LogNormal(4.0, 0.6), "
        f"outputs LogNormal(3.2, 0.6), n_share 0.2; grid {GRID}. Runs drain in "
        f"{min(steps)}..{max(steps)} steps; static capacity {capacity}. Wall times exclude "
        f"compiles (listed apart); `timed` says what was timed and extrapolated to {runs} runs. "
        f"1-minute load average {env['load_before']:.1f} before, {env['load_after']:.1f} after.", "",
        markdown_table(table, columns), "",
        f"Target {TARGET}x faster than the sequential reference: {'met' if best >= TARGET else 'not met'} "
        f"(best sweep {best:.2f}x).", "",
        f"Per step of one run ({run_steps} run-steps in all): the reference takes "
        f"{ref_s / run_steps * 1e6:.1f} us, so {TARGET}x leaves {ref_s / run_steps / TARGET * 1e6:.2f} us "
        f"per run-step; the fastest sweep spends {fastest / run_steps * 1e6:.1f} us of wall time per "
        f"run-step.", "",
        "## Per configuration", "",
        markdown_table(rows, list(rows[0])), ""])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sweep.md").write_text(md)
    trace_params = {k: dataclasses.asdict(v) if isinstance(v, LogNormal) else v for k, v in TRACE.items()}
    (RESULTS / "sweep.json").write_text(json.dumps(
        dict(trace=trace_params, grid=GRID, capacity=capacity, environment=env, methods=table, rows=rows),
        indent=1))
    plot_results(rows, RESULTS, "sweep")
    print(markdown_table(table, columns))
    print(f"wrote {RESULTS}/sweep.md, sweep.json, sweep_latency.png, sweep_preemptions.png")


if __name__ == "__main__":
    main()
