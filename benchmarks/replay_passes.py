"""What leaving XLA:CPU passes out of the replay's programs does to the sweep's chunk.

    python benchmarks/replay_passes.py [--size 16] [--chunks 8] [--rounds 10]

The 500-request trace and grid of `benchmarks/sweep.py` (--size configurations), on the CPU
map path (a loop over runs), one shard. The sweep's first call of its chunk is captured
(a block of `sweep.MAP_BLOCK` runs; before the map path stepped blocks, the whole batch);
its chunk is compiled with each option set (`compiler_options`, for that executable
only), and the executables then step copies of the same block through the first --chunks
chunks in turn, round after round in one process, so that load from elsewhere hits them
alike.
Reported per option set: XLA's compile (lowering apart; the least of --compiles, also
interleaved), the compiled program's fusions,
and per round the process CPU time and wall time of the chunks (medians over rounds).
Results go to benchmarks/results/replay_passes.{json,md}.
"""
from __future__ import annotations

import argparse
import re
import time

from _common import machine, save_results
from sweep import TRACE, grid

from jaxsched.entrypoints.xla_flags import use_xla_flags

use_xla_flags()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxsched.core.xla_options import LEAN_PASSES  # noqa: E402
from jaxsched.sim import sweep as sw  # noqa: E402
from jaxsched.sim.workload import generate_trace  # noqa: E402

PASSES = dict(LEAN_PASSES)["xla_disable_hlo_passes"]
OPTIONS = {
    "all of XLA's passes": {"xla_disable_hlo_passes": ""},
    "no tree reduction rewriter": {"xla_disable_hlo_passes": "tree_reduction_rewriter"},
    f"the replay's ({PASSES})": dict(LEAN_PASSES),
}


class _Captured(Exception):
    pass


def first_batch(size: int):
    """(args, static arguments) of the sweep's first chunk call (its first block), as host arrays."""
    got = {}
    real = sw._compiled

    def capture(fn, args, static, stats, compiler_options=None):
        if fn is sw.sweep_chunk:
            got.update(args=jax.tree.map(np.asarray, args), static=static)
            raise _Captured
        return real(fn, args, static, stats, compiler_options)
    sw._compiled = capture
    try:
        sw.sweep(generate_trace(**TRACE), **grid(size), vmap_runs=1, threads=1, progress=False, prune=False)
    except _Captured:
        pass
    finally:
        sw._compiled = real
    return got["args"], got["static"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=16)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--compiles", type=int, default=2, help="compiles of each option set (min kept)")
    args = ap.parse_args()
    (carry, cols, arrival, tokens, first, times), static = first_batch(args.size)
    k = times.shape[1]
    step_time = float(times[0, 1] - times[0, 0])
    exes, xla_s = {}, {name: [] for name in OPTIONS}
    for _ in range(args.compiles):            # interleaved, as the runs are
        for name, options in OPTIONS.items():
            jax.clear_caches()                # else JAX hands back the executable compiled before
            lowered = sw.sweep_chunk.trace(*jax.device_put((carry, cols, arrival, tokens, first, times)),
                                           **static).lower()
            start = time.perf_counter()
            exes[name] = lowered.compile(options)
            xla_s[name].append(time.perf_counter() - start)
    rows = [dict(options=name, xla_s=min(xla_s[name]),
                 fusions=len(re.findall(r"= \S+ fusion\(", exes[name].as_text()))) for name in OPTIONS]
    inputs = [jax.device_put((cols, arrival, tokens, first + c * k, times + c * k * step_time))
              for c in range(args.chunks)]
    cpu = {name: [] for name in exes}
    wall = {name: [] for name in exes}
    for _ in range(args.rounds):
        for name, exe in exes.items():
            state = jax.device_put(carry)
            jax.block_until_ready(state)
            c0, w0 = time.process_time(), time.perf_counter()
            for chunk in inputs:
                state, rec = exe(state, *chunk)
            jax.block_until_ready((state, rec))
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
    base = rows[0]["options"]
    for row in rows:
        name = row["options"]
        row.update(cpu_s=float(np.median(cpu[name])), wall_s=float(np.median(wall[name])),
                   wall_min_s=float(np.min(wall[name])))
    for row in rows:
        row.update(cpu_vs_all=row["cpu_s"] / rows[0]["cpu_s"], wall_vs_all=row["wall_s"] / rows[0]["wall_s"],
                   xla_vs_all=row["xla_s"] / rows[0]["xla_s"])
    cols_out = ("options", "xla_s", "fusions", "cpu_s", "wall_s", "wall_min_s", "xla_vs_all", "cpu_vs_all",
                "wall_vs_all")
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)   # noqa: E731
    lines = [f"# The replay's XLA passes: the sweep's chunk, {args.size} configurations {machine()}", "",
             f"The first {args.chunks} chunks ({args.chunks * k} steps) of the first batch of "
             f"{args.size} runs on the map path, one shard; {args.rounds} rounds interleaved in one "
             f"process; cpu_s and wall_s are medians over rounds, xla_s the least of {args.compiles} compiles each. "
             f"Ratios against `{base}`.", "",
             "| " + " | ".join(cols_out) + " |", "|" + "---:|" * len(cols_out)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols_out) + " |" for r in rows]
    markdown = "\n".join(lines) + "\n"
    print(markdown)
    save_results("replay_passes", dict(size=args.size, chunks=args.chunks, rounds=args.rounds, rows=rows),
                 markdown)


if __name__ == "__main__":
    main()
