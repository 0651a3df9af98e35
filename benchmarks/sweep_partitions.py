"""What XLA:CPU's intra-op partitions cost the threaded sweep: the same step with and without.

    python benchmarks/sweep_partitions.py [--configs 64] [--threads 2] [--rounds 3] [--repeats 3]

XLA:CPU splits a loop fusion it judges costly into parallel tasks on its intra-op thread pool
(`outer_dimension_partitions` in the optimized HLO). The pool's size, and so the split, is set
when the CPU client starts, from the CPUs the process may use; no XLA flag or compile option
changes it. The sweep's map path already keeps both cores busy with its own threads, so a
split step waits for a pool thread that the other run holds.

To see what that costs, the sweep's chunk is compiled twice into two persistent compilation
caches: once as usual, once by a process limited to one CPU (which compiles no split). Fresh
processes with every CPU then load either executable from its cache and run the 500-request
trace and grid of `benchmarks/sweep.py` (--configs configurations, map path, --threads
threads, every configuration run: no pruning), the two interleaved for --rounds rounds of
--repeats sweeps each. Then the cores themselves: one process limited to one CPU sweeps with
one thread, alone and then beside a second such process on the other CPU (the two cores run
two programs at once at full speed, which the map path's two threads in one process do not).
Results: benchmarks/results/sweep_partitions.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from _common import save_results
from sweep import TRACE, grid

from jaxsched.sim.workload import generate_trace

# Runs in a fresh process: argv is trace.json, axes (JSON), threads, repeats, cache dir.
WORKER = r"""
import json, os, sys
from jaxsched.entrypoints.xla_flags import use_xla_flags
use_xla_flags()
from jaxsched.entrypoints.compilation_cache import enable_compilation_cache
enable_compilation_cache(sys.argv[5])
from jaxsched.sim import sweep as sw
trace, axes = json.load(open(sys.argv[1])), json.loads(sys.argv[2])
out = dict(us_per_run_step=[], compile_s=[])
for _ in range(int(sys.argv[4])):
    stats = {}
    sw.sweep(trace, **axes, vmap_runs=1, threads=int(sys.argv[3]), prune=False, progress=False, stats=stats)
    out["us_per_run_step"].append(stats["run_s"] / stats["run_steps"] * 1e6)
    out["compile_s"].append(stats.get("compile_s", 0.0))
hlo = "\n".join(exe.as_text() or "" for key, exe in sw._EXECUTABLES.items() if key[0] is sw.sweep_chunk)
out["split_fusions"] = sum('"outer_dimension_partitions":["' in line for line in hlo.splitlines())
out["cpus"] = len(os.sched_getaffinity(0))
print(json.dumps(out))
"""


def start(path, axes, threads: int, repeats: int, cache: pathlib.Path, cpu: int | None = None):
    """A worker process sweeping the grid `repeats` times; `cpu`: limited to that one CPU."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.Popen([sys.executable, "-c", WORKER, str(path), json.dumps(axes), str(threads),
                             str(repeats), str(cache)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu})))


def result(proc) -> dict:
    out, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"worker failed:\n{err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def run(*args, **kwargs) -> dict:
    return result(start(*args, **kwargs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if not hasattr(os, "sched_setaffinity"):
        raise SystemExit("needs os.sched_setaffinity (Linux)")
    axes = grid(args.configs)
    load_before = os.getloadavg()[0]
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        path = tmp / "trace.json"
        path.write_text(json.dumps(generate_trace(**TRACE)))
        caches = {"split (as compiled)": tmp / "split", "no split (compiled on one CPU)": tmp / "whole"}
        cpus = sorted(os.sched_getaffinity(0))
        run(path, axes, args.threads, 1, caches["no split (compiled on one CPU)"], cpus[0])
        first = {name: run(path, axes, args.threads, 1, cache) for name, cache in caches.items()}
        # One thread per process, one CPU each: alone, then two at once on two CPUs.
        one_core = run(path, axes, 1, args.repeats, tmp / "single", cpus[0])
        pair = [result(p) for p in [start(path, axes, 1, args.repeats, tmp / "single", cpu) for cpu in cpus[:2]]]
        samples = {name: [] for name in caches}
        for rnd in range(args.rounds):
            for name, cache in caches.items():
                got = run(path, axes, args.threads, args.repeats, cache)
                assert got["split_fusions"] == first[name]["split_fusions"], (name, got, first[name])
                samples[name] += got["us_per_run_step"]
                print(f"round {rnd + 1} {name}: {[round(x, 1) for x in got['us_per_run_step']]} us per run-step",
                      flush=True)
    rows = [dict(executable=name, cpus=os.cpu_count(), split_fusions=first[name]["split_fusions"],
                 us_per_run_step_median=statistics.median(s), us_per_run_step_min=min(s),
                 samples=[round(x, 1) for x in s]) for name, s in samples.items()]
    single = [("one process on one CPU, one thread", 1, one_core["us_per_run_step"])]
    if len(pair) == 2:
        # Two processes at once: the pair's cost per run-step is that of each, halved.
        single.append(("two such processes at once, one CPU each (the pair)", 2,
                       [1 / (1 / a + 1 / b) for a, b in zip(pair[0]["us_per_run_step"], pair[1]["us_per_run_step"])]))
        single.append(("each process of the pair", 1, pair[0]["us_per_run_step"] + pair[1]["us_per_run_step"]))
    for name, cpus_used, s in single:
        rows.append(dict(executable=name, cpus=cpus_used, split_fusions=one_core["split_fusions"],
                         us_per_run_step_median=statistics.median(s), us_per_run_step_min=min(s),
                         samples=[round(x, 1) for x in s]))
    base = rows[0]["us_per_run_step_median"]
    lines = [f"# XLA:CPU intra-op splits in the threaded sweep: {args.configs} configurations, "
             f"{args.threads} threads ({platform.machine()}, {os.cpu_count()} CPUs)", "",
             f"`python benchmarks/sweep_partitions.py --configs {args.configs} --threads {args.threads} "
             f"--rounds {args.rounds} --repeats {args.repeats}`: the map path, no pruning, the chunk "
             f"compiled as usual or by a process on one CPU (no fusion split), loaded from a persistent "
             f"cache by fresh processes, interleaved; then one-thread processes limited to one CPU each, "
             f"alone and two at once. Cost per run-step, compile apart. 1-minute load "
             f"average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after; "
             f"{time.perf_counter() - began:.0f} s in all.", "",
             "| executable | CPUs | split fusions | us/run-step (median) | min | vs split | samples |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['executable']} | {r['cpus']} | {r['split_fusions']} | {r['us_per_run_step_median']:.1f} "
                     f"| {r['us_per_run_step_min']:.1f} | {base / r['us_per_run_step_median']:.2f}x "
                     f"| {', '.join(map(str, r['samples']))} |")
    markdown = "\n".join(lines) + "\n"
    print(markdown)
    save_results("sweep_partitions", dict(configs=args.configs, threads=args.threads, rounds=args.rounds,
                                          repeats=args.repeats, rows=rows), markdown)


if __name__ == "__main__":
    main()
