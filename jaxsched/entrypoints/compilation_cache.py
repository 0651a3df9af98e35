"""JAX's persistent compilation cache, on by default for the front ends.

A second start with the same settings loads its executables from disk instead of compiling
them again. The directory is, in order: the `path` argument (the CLI's
`--compilation-cache-dir`), the environment variable JAXSCHED_COMPILATION_CACHE_DIR, a
directory the user already gave JAX (`jax_compilation_cache_dir`), else
`$XDG_CACHE_HOME/jaxsched/xla` (`~/.cache/jaxsched/xla`). "off" (or an empty value)
disables it.

The cache is bounded (`MAX_SIZE_BYTES`, least recently used entries evicted). Setting a bound
also makes JAX guard every read and write with a file lock; without one an entry is written
in place, and a second process (two servers, a server and the CLI) can read it half-written.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

ENV_VAR = "JAXSCHED_COMPILATION_CACHE_DIR"
OFF = {"", "off", "none", "0", "false"}
MAX_SIZE_BYTES = 4 << 30


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxsched" / "xla"


def resolve_cache_dir(path: Optional[str] = None) -> Optional[Path]:
    """Where the cache goes, or None when it is off."""
    import jax
    value = path if path is not None else os.environ.get(ENV_VAR)
    if value is None:
        value = jax.config.jax_compilation_cache_dir or default_cache_dir()
    if str(value).strip().lower() in OFF:
        return None
    return Path(value).expanduser()


def enable_compilation_cache(path: Optional[str] = None) -> Optional[Path]:
    """Point JAX's persistent cache at the resolved directory; returns it (None: off)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache
    where = resolve_cache_dir(path)
    if where is None:
        if jax.config.jax_compilation_cache_dir is not None:
            jax.config.update("jax_compilation_cache_dir", None)
            compilation_cache.reset_cache()
        return None
    if jax.config.jax_compilation_cache_dir == str(where):
        return where
    where.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(where))
    # The engine's step compiles in seconds, the scheduler's small jits in well under one:
    # cache everything that took a little time, whatever its size.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if jax.config.jax_compilation_cache_max_size == -1:     # -1: JAX's unbounded, unlocked default
        jax.config.update("jax_compilation_cache_max_size", MAX_SIZE_BYTES)
    compilation_cache.reset_cache()           # a cache set up earlier without a directory
    return where
