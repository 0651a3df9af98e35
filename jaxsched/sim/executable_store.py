"""Compiled replay chunks (`sweep`'s and `simulate`'s) kept on disk, found without tracing.

JAX's persistent compilation cache keys an executable by its lowered HLO, so a start that
hits it has still traced and lowered the chunk first: about 1.9 s of the 2.8-2.9 s a
cached sweep compile took (benchmarks/results/sweep.md), about 2 s of a warm `jaxsched
simulate`. This store keys the executable by what that HLO is made from instead: jaxsched's
source, jax's version and the options that change a trace, the backend and the host's CPU,
XLA_FLAGS and the compile options, the function, its static arguments and its arguments'
structure and shapes. A hit deserializes the executable
(`jax.experimental.serialize_executable`) and skips all three steps.

It lives beside JAX's cache, in `<jax_compilation_cache_dir>/jaxsched-executables` (JAX's
own eviction looks only at the top level), and is on exactly when that cache is: the front
ends turn it on by default, `JAXSCHED_COMPILATION_CACHE_DIR=off` turns both off. Entries
are written whole (a temporary file renamed into place), so a second process never reads
one half-written; an entry that does not load is deleted and compiled again; the
`MAX_ENTRIES` most recently used are kept.

An executable that JAX's cache gave serializes without its code on XLA:CPU (loading it
fails with "Function ... not found"), so what this store saves is compiled with JAX's cache
off (`compile_fresh`). Entries are pickles, read only from the user's own cache directory,
as JAX's cache entries are.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import os
import pathlib
import pickle
import platform
import tempfile
import time
from typing import Any

import jax
import jaxlib

SUBDIR = "jaxsched-executables"
SUFFIX = ".exe"
# A sweep chunk's entry is about 3.6 MB on XLA:CPU; a sweep writes one per capacity and
# batch shape (two with half slots), simulate one per capacity and arrival width.
MAX_ENTRIES = 32
# jax options that change what a trace gives, besides the arguments.
TRACE_OPTIONS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_dtype_promotion",
                 "jax_numpy_rank_promotion", "jax_default_prng_impl", "jax_threefry_partitionable")


def directory() -> pathlib.Path | None:
    """Where entries go; None while JAX's persistent cache is off."""
    root = jax.config.jax_compilation_cache_dir
    return pathlib.Path(root) / SUBDIR if root else None


@functools.cache
def _source_digest() -> str:
    """jaxsched's own source: any change to the code a chunk is traced from is a new key."""
    package = pathlib.Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _cpu_flags() -> str:
    """The host CPU's feature flags (Linux): XLA:CPU compiles for the host's instruction set,
    and a cache directory may be shared between machines."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def key(name: str, static: dict, args, options: dict | None) -> str:
    """The entry's name for `name` (the function) compiled with these static arguments,
    arguments (their structure and shapes) and XLA options on the default backend."""
    device = jax.devices()[0]
    parts = [
        _source_digest(), jax.__version__, jaxlib.__version__,
        *(repr(getattr(jax.config, option, None)) for option in TRACE_OPTIONS),
        device.platform, device.device_kind, str(jax.device_count()),
        getattr(device.client, "platform_version", ""), platform.machine(), _cpu_flags(),
        os.environ.get("XLA_FLAGS", ""), repr(sorted((options or {}).items())),
        name, repr(sorted(static.items(), key=lambda kv: kv[0])), str(jax.tree.structure(args)),
        repr([(tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)))
              for x in jax.tree.leaves(args)]),
    ]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def stored(name: str, static: dict, args, options: dict | None) -> bool:
    """Is `name` (a function) with these static arguments, arguments (arrays or
    jax.ShapeDtypeStructs) and options kept here (the store on)?"""
    where = directory()
    return where is not None and (where / (key(name, static, args, options) + SUFFIX)).is_file()


def load(where: pathlib.Path, name: str) -> tuple[Any, bytes] | None:
    """(executable, its serialized bytes) of the entry `name`, or None (no entry, or one that
    does not load: deleted, so the caller compiles and saves it again)."""
    from jax.experimental.serialize_executable import deserialize_and_load
    path = where / (name + SUFFIX)
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    try:
        exe = deserialize_and_load(*pickle.loads(blob))
    except Exception:       # written by a crashed process, or a jaxlib that reads it no more
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    with contextlib.suppress(OSError):
        os.utime(path)                  # recently used: evicted last
    return exe, blob


def serialized(exe) -> bytes:
    """An executable's bytes for `load` or a worker process (`deserialize_and_load` of the
    unpickled tuple); it must not have come from JAX's cache (see the module)."""
    from jax.experimental.serialize_executable import serialize
    return pickle.dumps(serialize(exe), protocol=pickle.HIGHEST_PROTOCOL)


def save(where: pathlib.Path, name: str, blob: bytes) -> None:
    """Write the entry whole, then keep the MAX_ENTRIES most recently used. A store that
    cannot be written (read-only, full) costs the next start a compile, nothing more."""
    try:
        where.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=where, prefix=".partial-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, where / (name + SUFFIX))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        entries = []
        for path in where.glob("*" + SUFFIX):
            with contextlib.suppress(OSError):
                entries.append((path.stat().st_mtime, path))
        for _, path in sorted(entries, reverse=True)[MAX_ENTRIES:]:
            with contextlib.suppress(OSError):
                path.unlink()
    except OSError:
        pass


def compile_fresh(lowered, options: dict | None):
    """`lowered.compile(options)` by XLA itself, not from JAX's cache, so that it serializes
    with its code. JAX's cache is off for the duration (a global setting, and JAX decides
    once whether its cache is used until `reset_cache`: another thread compiling meanwhile
    only misses that cache)."""
    from jax.experimental.compilation_cache import compilation_cache
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        return lowered.compile(options)
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()


@contextlib.contextmanager
def _gc_paused():
    """Python's cyclic collector paused: tracing and lowering a sweep's chunk allocate some
    hundred thousand objects and set off collections that found nothing to free, about a
    tenth of the 0.9 s they take (probe: trace+lower 0.88-1.03 s with it, 0.81-0.85 without).
    The objects are freed by reference counting as ever; the collector resumes after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def compile_or_load(fn, args, static: dict, options: dict | None, stats: dict, store: bool = True):
    """(`fn` (a jitted function) compiled for `args` and its `static` arguments, its bytes
    or None): loaded from the store when it is on and has it, else traced, lowered and
    compiled, and saved there. `stats` sums the seconds: load_s, or trace_s, lower_s,
    xla_s and save_s; each into compile_s; and counts `loaded` or `compiles`."""
    t0 = time.perf_counter()
    where = directory() if store else None
    if where is not None:
        name = key(fn.__name__, static, args, options)
        found = load(where, name)
        if found is not None:
            seconds = time.perf_counter() - t0
            for field in ("load_s", "compile_s"):
                stats[field] = stats.get(field, 0.0) + seconds
            stats["loaded"] = stats.get("loaded", 0) + 1
            return found
    with _gc_paused():
        traced = fn.trace(*args, **static)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
    exe = compile_fresh(lowered, options) if where is not None else lowered.compile(options)
    t3 = end = time.perf_counter()
    blob = None
    if where is not None:
        blob = serialized(exe)
        save(where, name, blob)
        end = time.perf_counter()
        stats["save_s"] = stats.get("save_s", 0.0) + end - t3
    for field, seconds in (("trace_s", t1 - t0), ("lower_s", t2 - t1), ("xla_s", t3 - t2),
                           ("compile_s", end - t0)):
        stats[field] = stats.get(field, 0.0) + seconds
    stats["compiles"] = stats.get("compiles", 0) + 1
    return exe, blob
