"""XLA compile options for each part of the engine's step: plan, model, finish (`LazyStep`).

The step runs as three programs, and they want different things from XLA:CPU. The plan (the
scheduler, its block tables and the flat batch: integer bookkeeping over per-slot arrays)
is most of the compile and little of a step; the model and finish (sampling over the
vocabulary) are float work that LLVM's optimizations make several times faster.

Measured on SmolLM2-135M over two CPUs, 64-token buckets, 102 steps of up to 8 sequences
(`benchmarks/engine_compile_options.py`, medians of 2): the plan at LLVM -O0 with the classic
elemental emitters compiles in 5.8 s instead of 11.75 (tracing included) and runs 0.92 ms a
step against 0.93. Finish the same way would compile 1.6 s faster but run 9.8 ms a step
instead of 1.9 (the vocabulary's softmax and sort unvectorized), the model 7.5x slower. So
only the plan takes them, and only on the CPU backend (the GPU compilers' pipelines are left
as they are).
"""
from __future__ import annotations

import jax

from jaxsched.core.xla_options import Options

# LLVM at -O0 and XLA:CPU's classic elemental fusion emitters.
FAST_COMPILE: Options = (("xla_backend_optimization_level", 0), ("xla_cpu_use_fusion_emitters", False))
# XLA's own defaults, spelled out: a part compiled with these is optimized even in a process
# whose XLA_FLAGS lower the level for everything else (the test suite's do).
OPTIMIZED: Options = (("xla_backend_optimization_level", 3), ("xla_cpu_use_fusion_emitters", True))

# Per part on the CPU backend; () compiles with the process's options (XLA_FLAGS).
CPU_PART_OPTIONS: dict[str, Options] = {"plan": FAST_COMPILE, "model": (), "finish": ()}


def part_options(part: str, platform: str | None = None) -> Options:
    """The compile options of `part` ("plan", "model" or "finish") on `platform` (default:
    JAX's default backend)."""
    if part not in CPU_PART_OPTIONS:
        raise ValueError(f"part must be one of {sorted(CPU_PART_OPTIONS)}, got {part!r}")
    return CPU_PART_OPTIONS[part] if (platform or jax.default_backend()) == "cpu" else ()
