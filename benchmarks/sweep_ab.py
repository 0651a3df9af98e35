"""Interleaved A/B of the map sweep: a git revision ("before") against the working tree ("after").

    python benchmarks/sweep_ab.py --before REV [--size 64] [--threads 2] [--rounds 3] [--reps 3] [--prune]

Both trees sweep the same 500-request trace and grid as `benchmarks/sweep.py --sizes SIZE`
(the trace is generated once, by this tree, and handed to both as JSON), each in its own
Python process with that tree's `jaxsched` first on sys.path, the persistent compilation
cache off and XLA_FLAGS as the tree's own CLI sets them. A process compiles and runs the grid
once, then times --reps more runs; the rounds alternate which tree goes first, so a drift of
the machine's load lands on both. Each tree's rows (steps and preemptions per configuration)
must be equal. The table gives cost per run-step (wall / run-steps, compile apart), best and
median, compile time and the optimized program's HLO instruction count where the tree keeps
its executables where this script can find them. Every configuration is run (the step's cost),
or with --prune each tree's pruned sweep (what pruning saves; run-steps are the whole grid's).

Results go to benchmarks/results/sweep_ab_<rev>_<size>x<threads>t.{md,json}.
"""

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"

# Runs inside each tree's own process: argv is trace.json, axes (JSON), threads, reps, prune.
DRIVER = r"""
import inspect, json, os, sys, time
try:
    from jaxsched.entrypoints.xla_flags import use_xla_flags
    use_xla_flags()
except ImportError:                      # a tree from before the CLI set XLA flags
    pass
import jaxsched
from jaxsched.sim import sweep as sw

trace, axes = json.load(open(sys.argv[1])), json.loads(sys.argv[2])
threads, reps, prune = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
accepted = inspect.signature(sw.sweep).parameters
# Every configuration run (no pruning, where the tree has it) compares the step's cost.
kwargs = {k: v for k, v in dict(vmap_runs=1, threads=threads, progress=False, prune=prune).items()
          if k in accepted}

def once():
    stats = {}
    t0 = time.perf_counter()
    rows = sw.sweep(trace, **axes, **kwargs, **({"stats": stats} if "stats" in accepted else {}))
    wall = time.perf_counter() - t0
    steps = stats.get("run_steps", sum(r["steps"] for r in rows))
    return rows, stats.get("compile_s"), stats.get("run_s", wall), steps

rows, compile_s, _, _ = once()
us = []
for _ in range(reps):
    _, _, run_s, steps = once()
    us.append(run_s / steps * 1e6)
exes = getattr(sw, "_EXECUTABLES", {})
hlo = [sum(1 for line in e.as_text().splitlines() if " = " in line) for e in exes.values()]
print(json.dumps(dict(package=os.path.dirname(jaxsched.__file__), compile_s=compile_s, us=us,
                      hlo_instructions=hlo,
                      rows=[[r["steps"], r["num_preemptions"]] for r in rows])))
"""


def export(rev: str, into: pathlib.Path) -> None:
    """The tracked files of `rev` under `into` (no worktree left behind)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def measure(tree: pathlib.Path, trace_path, axes, threads, reps, prune=False) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), JAXSCHED_COMPILATION_CACHE_DIR="off")
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-c", DRIVER, str(trace_path), json.dumps(axes), str(threads),
                          str(reps), "1" if prune else "0"], env=env, cwd=tree, check=True, capture_output=True, text=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if not pathlib.Path(got["package"]).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"{tree}: imported jaxsched from {got['package']}, not from the tree")
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="git revision to compare the working tree with")
    ap.add_argument("--size", type=int, default=64, help="configurations (a multiple of 8)")
    ap.add_argument("--threads", type=int, default=2, help="host threads of the map sweep")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3, help="timed runs per process, after a compiling one")
    ap.add_argument("--prune", action="store_true", help="time each tree's pruned sweep, not every run")
    args = ap.parse_args()
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.before], check=True,
                         capture_output=True, text=True).stdout.strip()
    sys.path.insert(0, str(HERE))
    from sweep import TRACE, grid
    from jaxsched.sim.workload import generate_trace

    axes = grid(args.size)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        before = pathlib.Path(tmp) / "before"
        before.mkdir()
        export(rev, before)
        trace_path = pathlib.Path(tmp) / "trace.json"
        trace_path.write_text(json.dumps(generate_trace(**TRACE)))
        trees = {"before": before, "after": ROOT}
        runs = {name: [] for name in trees}
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(trees)[::-1]
            for name in order:
                runs[name].append(measure(trees[name], trace_path, axes, args.threads, args.reps, args.prune))
                print(f"round {r + 1} {name}: " + " ".join(f"{u:.1f}" for u in runs[name][-1]["us"])
                      + " us per run-step", flush=True)
    rows = {name: [run["rows"] for run in got] for name, got in runs.items()}
    if any(r != rows["after"][0] for got in rows.values() for r in got):
        raise SystemExit("the trees' rows differ: not the same schedule, so not an A/B")

    def summary(name):
        us = [u for run in runs[name] for u in run["us"]]
        compiles = [run["compile_s"] for run in runs[name] if run["compile_s"] is not None]
        hlo = runs[name][0]["hlo_instructions"]
        return dict(tree=name, best_us=min(us), median_us=statistics.median(us),
                    compile_s=statistics.median(compiles) if compiles else None,
                    hlo_instructions=hlo[0] if len(hlo) == 1 else (hlo or None),
                    rounds=[run["us"] for run in runs[name]])

    table = [summary(name) for name in trees]
    env = dict(machine=platform.machine(), cpus=os.cpu_count(), load_before=load_before,
               load_after=os.getloadavg()[0])
    fmt = lambda x, spec: "-" if x is None else format(x, spec)
    pruned = ", pruned" if args.prune else ""
    lines = [f"# {args.size}-configuration map sweep{pruned}: {rev} (before) against the working tree (after)", "",
             f"`python benchmarks/sweep_ab.py --before {args.before} --size {args.size} --threads "
             f"{args.threads} --rounds {args.rounds} --reps {args.reps}{' --prune' if args.prune else ''}`: "
             f"the trace and grid of `benchmarks/sweep.py --sizes {args.size}`, "
             f"`sweep(..., vmap_runs=1, threads={args.threads}, prune={args.prune})`, "
             f"{args.reps} timed runs per process after a compiling one, trees alternating first. "
             f"Both trees' rows are equal. {env['machine']}, {env['cpus']} CPUs, 1-minute load average "
             f"{env['load_before']:.1f} before, {env['load_after']:.1f} after.", "",
             "| tree | best us/run-step | median us/run-step | compile_s | HLO instructions | per round |",
             "|---|---:|---:|---:|---:|---|"]
    for t in table:
        per_round = " / ".join(" ".join(f"{u:.1f}" for u in us) for us in t["rounds"])
        lines.append(f"| {t['tree']} | {t['best_us']:.1f} | {t['median_us']:.1f} | "
                     f"{fmt(t['compile_s'], '.1f')} | {t['hlo_instructions'] or '-'} | {per_round} |")
    b, a = table
    lines += ["", f"after / before: best {a['best_us'] / b['best_us']:.2f}x, "
                  f"median {a['median_us'] / b['median_us']:.2f}x.", ""]
    RESULTS.mkdir(exist_ok=True)
    name = f"sweep_ab_{rev}_{args.size}x{args.threads}t" + ("_pruned" if args.prune else "")
    (RESULTS / f"{name}.md").write_text("\n".join(lines))
    (RESULTS / f"{name}.json").write_text(json.dumps(
        dict(before=args.before, rev=rev, size=args.size, threads=args.threads, prune=args.prune, environment=env,
             trees=table), indent=1))
    print("\n".join(lines))
    print(f"wrote {RESULTS}/{name}.md, .json")


if __name__ == "__main__":
    main()
