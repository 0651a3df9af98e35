"""The XLA flags jaxsched's commands run with unless XLA_FLAGS is already set.

XLA reads XLA_FLAGS when its backend starts (the first computation), not when jax is
imported, so `use_xla_flags()` takes effect anywhere before that.
"""
from __future__ import annotations

import os

# The scheduler's step is hundreds of tiny fusions: XLA:CPU's concurrency-optimized
# scheduler only adds thread hand-offs between them (and compile time).
CPU_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",)
# On a GPU, XLA runs each lax.cond by copying its predicate to the host and launching the
# branch from there; as CUDA graphs with conditional nodes, loops and conds are decided on
# the device. The 1024-run sweep: 3.33 -> 2.89 us per run-step on an H200
# (benchmarks/results/sweep_gpu_cmdbuf.md). A GPU-only option: other backends ignore it.
SWEEP_GPU_FLAGS = ("--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE",)
_ours: list[str] = []      # the value use_xla_flags set, so a later call may extend it


def use_xla_flags(*extra: str) -> str:
    """Set XLA_FLAGS to CPU_FLAGS and `extra` unless the user has set it; a value this
    function set before is extended by `extra`. Returns its value."""
    if "XLA_FLAGS" not in os.environ:
        flags = list(CPU_FLAGS)
    elif os.environ["XLA_FLAGS"] in _ours:
        flags = os.environ["XLA_FLAGS"].split()
    else:
        return os.environ["XLA_FLAGS"]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f for f in extra if f not in flags])
    _ours.append(os.environ["XLA_FLAGS"])
    return os.environ["XLA_FLAGS"]
