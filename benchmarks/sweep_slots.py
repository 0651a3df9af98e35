"""What a sweep's slot count costs: cost per run-step against the static number of slots.

    python benchmarks/sweep_slots.py [--slots 64,96,128,256] [--blocks 20,24,32,40]
                                     [--grid-slots 96,128] [--reps 3]

Three tables, the 500-request trace of `benchmarks/sweep.py`, one process, the persistent
cache off:
  one thread:  the map path on one thread over four configurations that never have more
               than 64 requests alive (recompute, max_num_seqs 64, 240..252 device blocks),
               every configuration run, at each of --slots: how a step's cost grows with
               the slots it carries (a fit: fixed part plus a cost per slot)
  table width: the same at 128 slots, with the trace's block tables (max_seqs_per_group 4,
               max_blocks_per_seq 20) and wider ones (--blocks: what rounding the table
               width up to capacity.bucket's steps, or to powers of two, costs), and twice
               as many sequences per group
  the grid:    the 64-configuration grid of `benchmarks/sweep.py`, pruned, on the default
               threads, at each of --grid-slots (its busiest run has 96 requests alive; the
               sweep's own guess, 2 * pow2(max_num_seqs), is 128)
Each slot count compiles once; the timed sweeps run in interleaved rounds (--reps), cost
per run-step the sweep's own `run_s` over its run-steps; medians. Results go to
benchmarks/results/sweep_slots.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
from _common import machine, save_results
from sweep import TRACE, grid

from jaxsched.entrypoints.xla_flags import use_xla_flags

use_xla_flags()

from jaxsched.entrypoints.cli_sweep import markdown_table  # noqa: E402
from jaxsched.sim.sweep import sweep  # noqa: E402
from jaxsched.sim.workload import generate_trace  # noqa: E402

SMALL = dict(preemption_mode="recompute", max_num_seqs="64", num_device_blocks="240,244,248,252")


def cost(trace, axes: dict, capacity: dict, **kwargs) -> tuple[float, dict]:
    """(us per run-step, stats) of one sweep with this static capacity."""
    stats = {}
    sweep(trace, **axes, capacity=capacity, progress=False, stats=stats, workers=False, **kwargs)
    return stats["run_s"] / stats["run_steps"] * 1e6, stats


def interleaved(trace, axes: dict, capacities: list[dict], reps: int, **kwargs) -> list[dict]:
    """Rows of medians for each capacity; one compiling sweep each first, untimed."""
    compile_s = [cost(trace, axes, c, **kwargs)[1]["compile_s"] for c in capacities]
    samples = [[] for _ in capacities]
    for _ in range(reps):
        for i, c in enumerate(capacities):
            samples[i].append(cost(trace, axes, c, **kwargs)[0])
    return [dict(c, us_per_run_step=float(np.median(t)), spread=f"{min(t):.1f}-{max(t):.1f}",
                 compile_s=seconds) for c, t, seconds in zip(capacities, samples, compile_s)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", default="64,96,128,256")
    ap.add_argument("--blocks", default="20,24,32,40")
    ap.add_argument("--grid-slots", default="96,128")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    trace = generate_trace(**TRACE)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    slots = lambda spec: [dict(num_slots=int(s)) for s in spec.split(",")]   # noqa: E731
    small = interleaved(trace, SMALL, slots(args.slots), args.reps, prune=False, threads=1)
    wide = interleaved(trace, SMALL, [dict(num_slots=128, max_seqs_per_group=4, max_blocks_per_seq=m)
                                      for m in map(int, args.blocks.split(","))]
                       + [dict(num_slots=128, max_seqs_per_group=8, max_blocks_per_seq=20)],
                       args.reps, prune=False, threads=1)
    x = np.array([r["num_slots"] for r in small], float)
    y = np.array([r["us_per_run_step"] for r in small])
    per_slot, fixed = np.polyfit(x, y, 1)
    for r in small:
        r["fit"] = round(fixed + per_slot * r["num_slots"], 1)
    big = interleaved(trace, grid(64), slots(args.grid_slots), args.reps)
    for r in big:
        r["vs_last"] = r["us_per_run_step"] / big[-1]["us_per_run_step"]
    for r in small + wide + big:
        r["us_per_run_step"] = round(r["us_per_run_step"], 1)
        r["compile_s"] = round(r["compile_s"], 2)
    for r in big:
        r["vs_last"] = round(r["vs_last"], 2)
    seconds = time.perf_counter() - t0
    head = f"# Sweep cost against its slot count {machine()}"
    lines = [head, "",
             f"`python benchmarks/sweep_slots.py --slots {args.slots} --blocks {args.blocks} "
             f"--grid-slots {args.grid_slots} "
             f"--reps {args.reps}`: medians of {args.reps} interleaved sweeps per row, compile apart. "
             f"1-minute load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after; "
             f"{seconds:.0f} s in all.", "",
             "## One thread, four configurations that never need more than 64 slots", "",
             markdown_table(small, ["num_slots", "us_per_run_step", "spread", "fit", "compile_s"]), "",
             f"Fit: {fixed:.1f} us + {per_slot:.3f} us per slot per run-step.", "",
             "## The same at 128 slots, wider block tables", "",
             markdown_table(wide, ["num_slots", "max_seqs_per_group", "max_blocks_per_seq",
                                   "us_per_run_step", "spread", "compile_s"]), "",
             "## The 64-configuration grid, pruned, default threads (its busiest run: 96 alive)", "",
             markdown_table(big, ["num_slots", "us_per_run_step", "spread", "vs_last", "compile_s"]), ""]
    text = "\n".join(lines)
    print(text)
    save_results("sweep_slots", dict(one_thread=small, table_width=wide, grid_64=big, fixed_us=fixed, per_slot_us=per_slot,
                                     seconds=seconds), text)


if __name__ == "__main__":
    main()
