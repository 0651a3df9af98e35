"""XLA compile options of the scheduler's own programs: the model-free replays of `simulate`
and `sweep` (the engine's parts have theirs in engine/compile_options.py).

A replay is the scheduler alone, stepped thousands of times: it keeps LLVM's optimizations
(at -O0 the sweep's steps ran 7x slower), at -O2, and leaves out two of XLA:CPU's passes.
"""
from __future__ import annotations

import os

import jax

Options = tuple[tuple[str, object], ...]

# Two XLA:CPU passes that cost the scheduler's programs (integer bookkeeping over arrays of
# a few hundred entries at most) more than they give. The tree reduction rewriter splits
# every reduction over more than 32 entries into a reduce-window and a reduce, two kernels
# instead of one (the sweep's chunk: 742 fusions -> 618); the parallel task assigner splits
# ops over XLA's intra-op threads, which the sweep's own threads keep busy. Reductions over
# integers (and float32 sums of integers below 2**24) are exact in any order: decisions do
# not change. The sweep's chunk at 16 configurations on one thread, interleaved in one
# process (benchmarks/replay_passes.py, results/replay_passes.md): without both, 0.80x the
# CPU and 0.85x the wall time of its steps, 0.94x XLA's compile; without the rewriter alone
# 0.90x, 0.90x and 0.97x.
LEAN_PASSES: Options = (("xla_disable_hlo_passes", "tree_reduction_rewriter,cpu-parallel-task-assigner"),)
# LLVM at -O2 instead of XLA:CPU's -O3: the chunk is some 600 small kernels, each optimized
# on its own, and -O3's extra passes find nothing in them. The sweep's chunk at 16
# configurations, fresh processes, 5 rounds interleaved: XLA's compile 0.93x (4.34 against
# 4.67 s best), the run 0.97x (benchmarks/results/sweep_compile_o2.md; -O1 costs the run
# 1.13x, benchmarks/results/sweep_compile.md).
LLVM_O2: Options = (("xla_backend_optimization_level", 2),)


def replay_options(platform: str | None = None) -> Options:
    """The replays' compile options on `platform` (default: JAX's default backend):
    LEAN_PASSES and LLVM_O2 on the CPU (LLVM_O2 unless XLA_FLAGS sets an optimization level
    of its own, as the test suite's -O0 does: a per-program option would override it);
    elsewhere none (the GPU compilers' pipelines are left as they are)."""
    if (platform or jax.default_backend()) != "cpu":
        return ()
    level_set = "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", "")
    return LEAN_PASSES + (() if level_set else LLVM_O2)
