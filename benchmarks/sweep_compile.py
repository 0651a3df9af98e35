"""Where a sweep's compile goes, and what XLA:CPU's compile-time options trade for it.

    python benchmarks/sweep_compile.py [--size 16] [--rounds 2] [--only NAME,NAME] [--name FILE]

The 500-request trace and grid of `benchmarks/sweep.py` (--size configurations), swept by
the CPU default path (the map path, a loop over runs) on one thread, persistent cache off,
in a fresh process per option set, the option sets interleaved round by round. Each process
splits the compile of `sweep_chunk` into tracing (Python), lowering (to StableHLO) and XLA's compile,
which is given the option set as `compiler_options` (XLA's debug options, for this one
executable, added to the replays' own: core/xla_options.py; the front ends' XLA_FLAGS otherwise). The split is the sweep's own `stats`. The run is the sweep's `stats['run_s']`,
compile apart, per run-step (run-steps: the steps each run takes to drain, summed).
Results go to benchmarks/results/sweep_compile.{json,md} (--name: another file name).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

from _common import save_results
from sweep import TRACE, grid

from jaxsched.sim.workload import generate_trace

OPTIONS = {
    "the replays' own (LLVM -O2)": {},
    "LLVM -O3 (XLA:CPU's default)": {"xla_backend_optimization_level": 3},
    "LLVM -O1": {"xla_backend_optimization_level": 1},
    "LLVM -O1, no expensive passes": {"xla_backend_optimization_level": 1,
                                      "xla_llvm_disable_expensive_passes": True},
    "LLVM -O0": {"xla_backend_optimization_level": 0},
    "no expensive LLVM passes": {"xla_llvm_disable_expensive_passes": True},
    "classic fusion emitters": {"xla_cpu_use_fusion_emitters": False},
    "the tests' (-O0, classic emitters)": {"xla_backend_optimization_level": 0,
                                           "xla_cpu_use_fusion_emitters": False},
}

# Runs in a fresh process: argv is trace.json, axes (JSON), compiler options (JSON).
WORKER = r"""
import functools, json, sys
from jaxsched.entrypoints.xla_flags import use_xla_flags
use_xla_flags()
from jaxsched.sim import sweep as sw
from jaxsched.core.xla_options import replay_options
# Each option set on top of the replays' own (core/xla_options.py), as the front ends compile.
sw._executable = functools.partial(sw._executable, compiler_options={**dict(replay_options()),
                                                                     **json.loads(sys.argv[3])} or None)
stats = {}
sw.sweep(json.load(open(sys.argv[1])), **json.loads(sys.argv[2]), vmap_runs=1, threads=1,
         progress=False, stats=stats)
print(json.dumps({k: stats[k] for k in ("trace_s", "lower_s", "xla_s", "compile_s", "compiles",
                                        "run_s", "run_steps")}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default=None, help="comma-separated option set names (default: all)")
    ap.add_argument("--name", default="sweep_compile", help="results file name")
    args = ap.parse_args()
    chosen = {k: v for k, v in OPTIONS.items() if args.only is None or k in args.only.split(",")}
    if not chosen or (args.only and len(chosen) != len(args.only.split(","))):
        raise SystemExit(f"--only: option sets are {', '.join(OPTIONS)}")
    axes = grid(args.size)
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAXSCHED_COMPILATION_CACHE_DIR")}
    env["JAXSCHED_COMPILATION_CACHE_DIR"] = "off"
    load_before = os.getloadavg()[0]
    began = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "trace.json"
        path.write_text(json.dumps(generate_trace(**TRACE)))
        for rnd in range(args.rounds):
            for name, options in chosen.items():
                got = subprocess.run([sys.executable, "-c", WORKER, str(path), json.dumps(axes),
                                      json.dumps(options)], env=env, check=True, capture_output=True,
                                     text=True)
                run = dict(round=rnd + 1, options=name, **json.loads(got.stdout.strip().splitlines()[-1]))
                run["us_per_run_step"] = run["run_s"] / run["run_steps"] * 1e6
                runs.append(run)
                print(f"round {rnd + 1} {name}: compile {run['compile_s']:.1f} s "
                      f"(XLA {run['xla_s']:.1f} s), {run['us_per_run_step']:.0f} us/run-step", flush=True)
    table = []
    for name, options in chosen.items():
        mine = [r for r in runs if r["options"] == name]
        best = lambda key: min(r[key] for r in mine)
        table.append(dict(options=name, compiler_options=options, trace_s=best("trace_s"),
                          lower_s=best("lower_s"), xla_s=best("xla_s"), compile_s=best("compile_s"),
                          us_per_run_step=best("us_per_run_step"),
                          us_per_run_step_all=[round(r["us_per_run_step"], 1) for r in mine]))
    base = table[0]
    lines = [f"# Sweep compile: XLA:CPU options, {args.size} configurations, 500 requests "
             f"({platform.machine()}, {os.cpu_count()} CPUs)", "",
             f"The grid of benchmarks/sweep.py at {args.size} configurations, the map path on one "
             f"thread, a fresh process per option set, {args.rounds} rounds interleaved; best of "
             f"the rounds. 1-minute load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} "
             f"after; {time.perf_counter() - began:.0f} s in all.", "",
             "| options | trace_s | lower_s | xla_s | compile_s | us_per_run_step | vs default (compile, run) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in table:
        lines.append(f"| {row['options']} | {row['trace_s']:.2f} | {row['lower_s']:.2f} | {row['xla_s']:.2f} "
                     f"| {row['compile_s']:.2f} | {row['us_per_run_step']:.1f} "
                     f"({', '.join(map(str, row['us_per_run_step_all']))}) "
                     f"| {row['compile_s'] / base['compile_s']:.2f}x, "
                     f"{row['us_per_run_step'] / base['us_per_run_step']:.2f}x |")
    markdown = "\n".join(lines) + "\n"
    print(markdown)
    save_results(args.name, dict(size=args.size, rounds=args.rounds, table=table, runs=runs), markdown)


if __name__ == "__main__":
    main()
