"""Half slots (`sweep(..., half_slots=True)`): run time against the extra compile, by grid size.

    python benchmarks/sweep_half_slots.py [--sizes 64,256,1024] [--reps 3] [--cache-sizes 256,1024]
                                          [--workers]

The 500-request trace and grids of `benchmarks/sweep.py`, pruned, the map path on the
default threads (or, with --workers, worker processes: `sweep(workers=True)`), half slots
forced on or off. Per size, in one process: a sweep without
and one with half slots compile their chunks (compile_s; the half-slot chunk is the extra
compile), then --reps interleaved rounds of both, timed apart from compiles (the sweep's
own run_s); medians. `half_share` is the share of the run-steps made at half the slots.
Then, for --cache-sizes, fresh processes with a persistent compilation cache per path
(empty at the first start, holding its chunks at the second): what a start pays with and
without half slots, cold and from the cache (`jaxsched sweep` keeps such a cache).
Results go to benchmarks/results/sweep_half_slots.{json,md} (with --workers,
sweep_half_slots_workers.{json,md}).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from _common import machine, save_results
from sweep import TRACE, grid

from jaxsched.entrypoints.xla_flags import use_xla_flags

use_xla_flags()

from jaxsched.entrypoints.cli_sweep import markdown_table  # noqa: E402
from jaxsched.sim.sweep import default_threads, sweep  # noqa: E402
from jaxsched.sim.workload import generate_trace  # noqa: E402

# A fresh process: one pruned sweep with the cache given, its stats as JSON on the last line.
START = """
import json, sys
sys.path.insert(0, {bench!r})
from jaxsched.entrypoints.xla_flags import use_xla_flags
use_xla_flags()
from jaxsched.entrypoints.compilation_cache import enable_compilation_cache
enable_compilation_cache({cache!r})
from sweep import TRACE, grid
from jaxsched.sim.sweep import sweep
from jaxsched.sim.workload import generate_trace
stats = {{}}
sweep(generate_trace(**TRACE), **grid({size}), progress=False, stats=stats, half_slots={half},
      workers={workers})
print(json.dumps({{k: stats[k] for k in ("compile_s", "run_s", "wall_s")}}))
"""


WORKERS = False         # --workers: the shards on worker processes


def one(trace, axes, half: bool) -> dict:
    stats = {}
    sweep(trace, **axes, progress=False, stats=stats, half_slots=half, workers=WORKERS)
    return stats


def by_size(trace, size: int, reps: int) -> list[dict]:
    axes = grid(size)
    compiled = {half: one(trace, axes, half) for half in (False, True)}
    samples = {False: [], True: []}
    for r in range(reps):
        for half in ((False, True) if r % 2 == 0 else (True, False)):
            st = one(trace, axes, half)
            samples[half].append(st)
    rows = []
    for half in (False, True):
        us = [s["run_s"] / s["run_steps"] * 1e6 for s in samples[half]]
        last = samples[half][-1]
        rows.append(dict(configs=size, half_slots=half, us_per_run_step=round(float(np.median(us)), 1),
                         spread=f"{min(us):.1f}-{max(us):.1f}", run_s=round(float(np.median(
                             [s["run_s"] for s in samples[half]])), 2),
                         half_share=round(last.get("half_slot_run_steps", 0) / max(1, last["live_run_steps"]), 2),
                         compile_s=round(compiled[half]["compile_s"], 2)))
    rows[1]["vs_off"] = round(rows[1]["us_per_run_step"] / rows[0]["us_per_run_step"], 2)
    rows[1]["saved_s"] = round(rows[0]["run_s"] - rows[1]["run_s"], 2)
    return rows


def cached_starts(size: int) -> list[dict]:
    """Fresh processes, each path with a persistent cache of its own: a start that finds it
    empty, then one that finds its chunks there."""
    bench = os.path.dirname(os.path.abspath(__file__))
    out = []
    for half in (False, True):
        with tempfile.TemporaryDirectory() as cache:
            for start in ("empty cache", "its chunks cached"):
                code = START.format(bench=bench, cache=cache, size=size, half=half, workers=WORKERS)
                got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
                stats = json.loads(got.stdout.strip().splitlines()[-1])
                out.append(dict(configs=size, half_slots=half, start=start,
                                **{k: round(v, 2) for k, v in stats.items()}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,256,1024")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cache-sizes", default="256,1024", help="grid sizes of the fresh-process starts")
    ap.add_argument("--workers", action="store_true", help="the shards on worker processes, not threads")
    args = ap.parse_args()
    global WORKERS
    WORKERS = args.workers
    trace = generate_trace(**TRACE)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        rows += by_size(trace, size, args.reps)
        print(markdown_table(rows[-2:], list(rows[-1])), flush=True)
    starts = [row for size in args.cache_sizes.split(",") if size for row in cached_starts(int(size))]
    seconds = time.perf_counter() - t0
    head = f"# Half slots against the extra compile {machine()}"
    lines = [head, "",
             f"`python benchmarks/sweep_half_slots.py --sizes {args.sizes} --reps {args.reps} "
             f"--cache-sizes {args.cache_sizes}{' --workers' if WORKERS else ''}`: the pruned map sweep of "
             f"`benchmarks/sweep.py`'s grids on {default_threads()} "
             f"{'worker processes' if WORKERS else 'threads'}; medians of {args.reps} "
             f"interleaved rounds, compile apart (compile_s: each path's first sweep in the process). "
             f"1-minute load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after; "
             f"{seconds:.0f} s in all.", "",
             markdown_table(rows, ["configs", "half_slots", "us_per_run_step", "spread", "run_s", "vs_off",
                                   "saved_s", "half_share", "compile_s"]), ""]
    if starts:
        lines += ["## Fresh processes, one persistent compilation cache", "",
                  "Each row a fresh process, each path with a cache of its own: first empty, then "
                  "holding the chunks the first start compiled (tracing and lowering are paid again).", "",
                  markdown_table(starts, ["configs", "half_slots", "start", "compile_s", "run_s", "wall_s"]), ""]
    text = "\n".join(lines)
    print(text)
    save_results("sweep_half_slots_workers" if WORKERS else "sweep_half_slots",
                 dict(grid=rows, cached_starts=starts, seconds=seconds), text)


if __name__ == "__main__":
    main()
