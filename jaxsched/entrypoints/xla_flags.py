"""The XLA flags jaxsched's commands run with unless XLA_FLAGS is already set.

XLA reads XLA_FLAGS when its backend starts (the first computation), not when jax is
imported, so `use_xla_flags()` takes effect anywhere before that.
"""
from __future__ import annotations

import os

# The scheduler's step is hundreds of tiny fusions: XLA:CPU's concurrency-optimized
# scheduler only adds thread hand-offs between them (and compile time).
CPU_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",)


def use_xla_flags(*extra: str) -> str:
    """Set XLA_FLAGS to CPU_FLAGS and `extra` unless the user has set it; returns its value."""
    return os.environ.setdefault("XLA_FLAGS", " ".join(CPU_FLAGS + extra))
