"""KV cache sizing from memory, as vLLM's `gpu_memory_utilization` and `swap_space`.

    block_bytes = bytes_per_block(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32",
                                  block_size=16)                       # 737,280 for SmolLM2
    plan = plan_cache(MemoryProfile(total_bytes=8 << 30, source="injected", weights_bytes=...,
                                    peak_bytes=..., block_bytes=block_bytes, host_total_bytes=...),
                      gpu_memory_utilization=0.9, swap_space=4, max_num_seqs=16, ...)
    plan.num_device_blocks, plan.num_host_blocks, plan.log_lines()

The arithmetic is vLLM's (worker.determine_num_available_blocks): the device may use
`gpu_memory_utilization` x its memory; what the placed weights and the largest step's working
memory leave of that holds `num_device_blocks`; `swap_space` GiB of host memory per
tensor-parallel worker holds `num_host_blocks`. A block is K and V of every layer for
`block_size` tokens of this device's share of the KV heads. Each pool has one more block, the
null block 0, which is taken out of the budget here.

Where the memory comes from (`device_memory`): an accelerator's `memory_stats()['bytes_limit']`;
on CPU, which has no memory of its own, what this process may use, the smaller of the cgroup
limit and MemAvailable of /proc/meminfo. Every figure can be injected (tests, planning for a
device this machine does not have).

Two caps keep a sized pool to what can be used (both logged): never more device blocks than
`max_num_seqs` sequences of `max_model_len` tokens hold at once (more are never in use
together; on CPU, 0.9 x RAM would otherwise allocate gigabytes of zeros), and never more host
blocks than that either (enough to swap out every running sequence at full length).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Optional

import numpy as np

GiB = 1 << 30
# vLLM's CacheConfig.verify_with_parallel_config: swap over 70% of host memory is refused,
# over 40% warned about.
SWAP_ERROR_SHARE, SWAP_WARN_SHARE = 0.7, 0.4
# Default max_model_len on CPU when the user gives none: the model's context length, capped
# here because the block-table width, prompt buffer and token buffers are compiled shapes that
# grow with it, and on CPU the "device" is the RAM every other pool and process shares.
CPU_DEFAULT_MAX_MODEL_LEN = 1024
# When the working memory cannot be measured (no memory analysis), the analytic bound is
# multiplied by this: the measured temp of SmolLM2 at 512 tokens was 1.8x the bound's sum.
ANALYTIC_SAFETY = 2.0
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
log = logging.getLogger("jaxsched.engine.sizing")


class SizingError(ValueError):
    """A cache that cannot be sized: the message has the numbers and what to change."""


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB"


# ----------------------------------------------------------------------------- arithmetic

def bytes_per_block(*, num_layers: int, num_kv_heads: int, head_dim: int, dtype, block_size: int,
                    tensor_parallel_size: int = 1) -> int:
    """Bytes of one KV block on one device: K and V, every layer, this device's KV heads."""
    if num_kv_heads % tensor_parallel_size:
        raise SizingError(f"num_key_value_heads={num_kv_heads} is not divisible by "
                          f"tensor_parallel_size={tensor_parallel_size}")
    heads = num_kv_heads // tensor_parallel_size
    return 2 * num_layers * block_size * heads * head_dim * np.dtype(dtype).itemsize


def block_bytes_of(model_config, block_size: int, tensor_parallel_size: int = 1) -> int:
    """`bytes_per_block` of a models.llama.LlamaConfig."""
    mc = model_config
    return bytes_per_block(num_layers=mc.num_hidden_layers, num_kv_heads=mc.num_key_value_heads,
                           head_dim=mc.head_dim, dtype=_np_dtype(mc.dtype), block_size=block_size,
                           tensor_parallel_size=tensor_parallel_size)


def _np_dtype(name):
    import jax.numpy as jnp
    return jnp.dtype(name)


def blocks_for_tokens(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def max_useful_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """The most device blocks running sequences can hold at once (the capacity's table width,
    max_model_len + 1 tokens, times max_num_seqs)."""
    return max_num_seqs * blocks_for_tokens(max_model_len + 1, block_size)


def max_concurrency(num_device_blocks: int, max_model_len: int, block_size: int) -> float:
    """How many sequences of max_model_len tokens the device pool holds at once (vLLM's log)."""
    return num_device_blocks / blocks_for_tokens(max_model_len, block_size)


def device_blocks_for_budget(total_bytes: int, gpu_memory_utilization: float, weights_bytes: int,
                             peak_bytes: int, block_bytes: int) -> int:
    """Usable device blocks: (utilization x memory - weights - working memory) // block, less
    the null block; negative when the weights and working memory alone do not fit."""
    available = int(total_bytes * gpu_memory_utilization) - weights_bytes - peak_bytes
    return available // block_bytes - 1


def host_blocks_for_swap(swap_space: float, block_bytes: int) -> int:
    """Usable host blocks in `swap_space` GiB, less the null block (0 for no swap space)."""
    return max(0, int(swap_space * GiB) // block_bytes - 1)


# ----------------------------------------------------------------------------- memory sources

@dataclasses.dataclass(frozen=True)
class Memory:
    bytes: int
    source: str


def _read_int(path: str) -> Optional[int]:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None       # "max": no limit


def _meminfo(key: str, path: str = "/proc/meminfo") -> Optional[int]:
    try:
        for line in Path(path).read_text().splitlines():
            name, _, value = line.partition(":")
            if name == key:
                return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def process_memory(meminfo_key: str = "MemAvailable", meminfo_path: str = "/proc/meminfo",
                   cgroup_paths=CGROUP_LIMITS) -> Memory:
    """What this process may use on the host: the smaller of the cgroup limit and /proc/meminfo's
    `meminfo_key` (MemAvailable, or MemTotal for the host's size), named in `source`."""
    candidates = []
    for path in cgroup_paths:
        limit = _read_int(path)
        if limit is not None and limit < 1 << 60:      # cgroup v1 spells "no limit" as ~2^63
            candidates.append(Memory(limit, f"cgroup limit {path}"))
            break
    info = _meminfo(meminfo_key, meminfo_path)
    if info is not None:
        candidates.append(Memory(info, f"{meminfo_key} of {meminfo_path}"))
    if not candidates:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return Memory(int(pages), "physical pages (sysconf)")
    return min(candidates, key=lambda m: m.bytes)


def device_memory(device=None) -> Memory:
    """The memory of `device` (default: the first): memory_stats()['bytes_limit'] where the
    backend reports it, else (CPU) `process_memory()`."""
    import jax
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:                                  # noqa: BLE001  some backends raise
        stats = None
    if stats and stats.get("bytes_limit"):
        return Memory(int(stats["bytes_limit"]), f"{device.platform} memory_stats()['bytes_limit']")
    found = process_memory()
    return Memory(found.bytes, f"{device.platform}: no device memory of its own; {found.source}")


# ----------------------------------------------------------------------------- measuring

def placed_bytes(params) -> int:
    """Bytes the placed arrays of `params` take on one device (the first shard of each)."""
    import jax
    total = 0
    for leaf in jax.tree.leaves(params):
        shards = getattr(leaf, "addressable_shards", None)
        total += shards[0].data.nbytes if shards else np.asarray(leaf).nbytes
    return int(total)


def analytic_peak_bytes(model_config, num_tokens: int, num_rows: int) -> int:
    """A bound on one step's working memory, for when the compiler reports none: the
    activations of one layer at a time, this step's K/V of every layer, the sampled logits,
    times ANALYTIC_SAFETY."""
    mc = model_config
    item = np.dtype(_np_dtype(mc.dtype)).itemsize
    per_token = (3 * mc.hidden_size + 2 * mc.intermediate_size
                 + (mc.num_attention_heads + 2 * mc.num_key_value_heads) * mc.head_dim)
    step_kv = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim
    logits = num_rows * mc.vocab_size * 4
    return int(ANALYTIC_SAFETY * (num_tokens * (per_token + step_kv) * item + logits))


def measure_peak_bytes(forward, graphdef, params, kv_cache, *, num_tokens: int, num_rows: int,
                       blocks_per_seq: int, block_size: int, impl: str) -> Optional[int]:
    """Working memory of the model's forward at `num_tokens` (the largest token bucket): the
    compiled program's temp plus output bytes from XLA's memory analysis, or None where the
    backend reports none. Compiles the one bucket (seconds; the persistent compilation
    cache keeps it for the next start)."""
    import jax
    import jax.numpy as jnp

    from jaxsched.cache.attention import AttentionMetadata

    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)   # noqa: E731
    meta = AttentionMetadata(slot_mapping=i32(num_tokens), positions=i32(num_tokens),
                             seq_ids=i32(num_tokens), block_tables=i32(num_rows, blocks_per_seq),
                             context_lens=i32(num_rows), logits_indices=i32(num_rows),
                             num_valid=i32())
    try:
        compiled = jax.jit(forward, static_argnums=(0, 6)).lower(
            graphdef, params, i32(num_tokens), i32(num_tokens), meta, kv_cache, impl).compile()
        stats = compiled.memory_analysis()
    except Exception as e:                             # noqa: BLE001  fall back to the bound
        log.info("sizing: no memory analysis of the forward (%s); using the analytic bound", e)
        return None
    if stats is None:
        return None
    return int(stats.temp_size_in_bytes + stats.output_size_in_bytes)


@dataclasses.dataclass(frozen=True)
class MemoryProfile:
    """What sizing needs to know, measured (`profile_engine`) or injected.

    total_bytes: the device's memory (source: where that number came from); weights_bytes:
    the placed weights on one device; peak_bytes: the largest step's working memory
    (peak_source: "memory analysis" or "analytic bound"); block_bytes: one KV block on one
    device; host_total_bytes: the host's memory, for the swap_space check.
    """
    total_bytes: int
    source: str
    weights_bytes: int
    peak_bytes: int
    block_bytes: int
    host_total_bytes: int
    peak_source: str = "injected"
    tensor_parallel_size: int = 1


# ----------------------------------------------------------------------------- the plan

@dataclasses.dataclass(frozen=True)
class CachePlan:
    """The counts sizing chose and why: log_lines() says it as vLLM's start-up log does."""
    num_device_blocks: int
    num_host_blocks: int
    max_model_len: int
    block_size: int
    profile: Optional[MemoryProfile]
    gpu_memory_utilization: float
    swap_space: float
    device_sized: bool
    host_sized: bool
    fit_device_blocks: Optional[int] = None         # before the cap
    fit_host_blocks: Optional[int] = None
    warnings: tuple[str, ...] = ()

    @property
    def max_concurrency(self) -> float:
        return max_concurrency(self.num_device_blocks, self.max_model_len, self.block_size)

    def log_lines(self) -> list[str]:
        bs = self.block_size
        lines = []
        p = self.profile
        if p is not None and self.device_sized:
            lines.append(f"memory: {_gib(p.total_bytes)} ({p.source}) x gpu_memory_utilization "
                         f"{self.gpu_memory_utilization:g} = {_gib(p.total_bytes * self.gpu_memory_utilization)}; "
                         f"weights {_gib(p.weights_bytes)}, working memory {_gib(p.peak_bytes)} "
                         f"({p.peak_source}); {p.block_bytes} bytes per block of {bs} tokens")
        for what, sized, count, fit in (("device", self.device_sized, self.num_device_blocks, self.fit_device_blocks),
                                        ("host", self.host_sized, self.num_host_blocks, self.fit_host_blocks)):
            how = "explicit"
            if sized:
                how = f"sized from swap_space {self.swap_space:g} GiB" if what == "host" else "sized"
                if fit is not None and fit > count:
                    how += f"; {fit} fit, capped at max_num_seqs x blocks per max_model_len sequence"
            lines.append(f"# {what} blocks: {count} ({count * bs} tokens; {how})")
        lines.append(f"maximum concurrency for {self.max_model_len} tokens per request: "
                     f"{self.max_concurrency:.2f}x")
        return lines + list(self.warnings)


def check_swap_space(swap_space: float, tensor_parallel_size: int, host_total_bytes: int) -> Optional[str]:
    """vLLM's check: swap over 70% of host memory raises SizingError, over 40% returns a warning."""
    if not isinstance(swap_space, (int, float)) or isinstance(swap_space, bool) or swap_space < 0:
        raise SizingError(f"swap_space: must be a number of GiB >= 0, got {swap_space!r}")
    need = swap_space * GiB * tensor_parallel_size
    msg = (f"swap_space: {swap_space:g} GiB x {tensor_parallel_size} worker(s) = {_gib(need)} is "
           f"{need / host_total_bytes:.0%} of the host's {_gib(host_total_bytes)}")
    if need > SWAP_ERROR_SHARE * host_total_bytes:
        raise SizingError(f"{msg}, more than {SWAP_ERROR_SHARE:.0%}: lower swap_space")
    if need > SWAP_WARN_SHARE * host_total_bytes:
        return f"warning: {msg}, more than {SWAP_WARN_SHARE:.0%}; this may starve the host"
    return None


def plan_cache(profile: Optional[MemoryProfile], *, gpu_memory_utilization: float = 0.9,
               swap_space: float = 4, block_size: int, max_num_seqs: int,
               context_len: int, max_model_len: Optional[int] = None,
               default_max_model_len: Optional[int] = None,
               num_device_blocks: Optional[int] = None, num_host_blocks: Optional[int] = None,
               ) -> CachePlan:
    """Block counts and max_model_len from memory (vLLM's arithmetic; see the module doc).

    An explicit `num_device_blocks` / `num_host_blocks` wins over sizing (profile may then
    be None for it). `max_model_len` None means the model's `context_len` (capped at
    `default_max_model_len` if given), shortened with a warning to what the sized pool holds;
    an explicit one that the sized pool cannot hold is an error. Raises SizingError.
    """
    if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float)) \
            or not 0 < gpu_memory_utilization <= 1:
        raise SizingError(f"gpu_memory_utilization: must be in (0, 1], got {gpu_memory_utilization!r}")
    warnings = []
    tp = profile.tensor_parallel_size if profile else 1
    if num_host_blocks is None:
        warn = check_swap_space(swap_space, tp, profile.host_total_bytes)
        if warn:
            warnings.append(warn)
    explicit_len = max_model_len is not None
    length = max_model_len if explicit_len else min(context_len, default_max_model_len or context_len)
    fit_device = fit_host = None
    if num_device_blocks is None:
        p = profile
        budget = int(p.total_bytes * gpu_memory_utilization)
        if p.weights_bytes > budget:
            raise SizingError(
                f"the weights alone ({_gib(p.weights_bytes)} on each device) exceed "
                f"gpu_memory_utilization {gpu_memory_utilization:g} x {_gib(p.total_bytes)} "
                f"({p.source}) = {_gib(budget)}: raise gpu_memory_utilization, or use a smaller "
                f"dtype or a larger tensor_parallel_size")
        fit_device = device_blocks_for_budget(p.total_bytes, gpu_memory_utilization, p.weights_bytes,
                                              p.peak_bytes, p.block_bytes)
        if fit_device < 1:
            raise SizingError(
                f"no room for the KV cache: gpu_memory_utilization {gpu_memory_utilization:g} x "
                f"{_gib(p.total_bytes)} = {_gib(budget)}, less weights {_gib(p.weights_bytes)} and "
                f"working memory {_gib(p.peak_bytes)} ({p.peak_source}), leaves less than two "
                f"blocks of {p.block_bytes} bytes: raise gpu_memory_utilization or lower "
                f"max_num_batched_tokens")
        need = blocks_for_tokens(length, block_size)
        if need > fit_device:
            if explicit_len:
                raise SizingError(
                    f"max_model_len {length}: one sequence needs {need} blocks, the cache has "
                    f"{fit_device}: raise gpu_memory_utilization or lower max_model_len")
            shorter = fit_device * block_size
            warnings.append(f"warning: max_model_len lowered from {length} to {shorter}, the most "
                            f"tokens the KV cache ({fit_device} blocks) holds")
            log.warning("sizing: %s", warnings[-1])
            length = shorter
        num_device_blocks = min(fit_device, max_useful_blocks(max_num_seqs, length, block_size))
    elif blocks_for_tokens(length, block_size) > num_device_blocks:
        # An explicit small cache is allowed (the scheduler ignores a request that can never
        # fit, as vLLM's can_allocate does): said, not refused.
        warnings.append(f"note: a sequence of max_model_len {length} tokens needs "
                        f"{blocks_for_tokens(length, block_size)} blocks, more than the explicit "
                        f"num_device_blocks={num_device_blocks}; such requests are ignored")
    host_sized = num_host_blocks is None
    if host_sized:
        fit_host = host_blocks_for_swap(swap_space, profile.block_bytes)
        num_host_blocks = min(fit_host, max_useful_blocks(max_num_seqs, length, block_size))
    return CachePlan(num_device_blocks=int(num_device_blocks), num_host_blocks=int(num_host_blocks),
                     max_model_len=int(length), block_size=block_size, profile=profile,
                     gpu_memory_utilization=gpu_memory_utilization, swap_space=swap_space,
                     device_sized=fit_device is not None, host_sized=host_sized,
                     fit_device_blocks=fit_device, fit_host_blocks=fit_host, warnings=tuple(warnings))


# ----------------------------------------------------------------------------- the engine's start-up

def check_args(gpu_memory_utilization, swap_space) -> None:
    """The two knobs' own checks, before any model loads (SizingError)."""
    if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float)) \
            or not 0 < gpu_memory_utilization <= 1:
        raise SizingError(f"gpu_memory_utilization: must be in (0, 1], got {gpu_memory_utilization!r}")
    if isinstance(swap_space, bool) or not isinstance(swap_space, (int, float)) or swap_space < 0:
        raise SizingError(f"swap_space: must be a number of GiB >= 0, got {swap_space!r}")


def default_max_model_len(context_len: int, backend: str) -> int:
    """The model's context length; on CPU at most CPU_DEFAULT_MAX_MODEL_LEN (see there)."""
    return min(context_len, CPU_DEFAULT_MAX_MODEL_LEN) if backend == "cpu" else context_len


def profile_engine(model_config, params, forward, graphdef, kv_cache, *, block_size: int,
                   max_num_batched_tokens: int, max_num_seqs: int, blocks_per_seq: int,
                   impl: str, tensor_parallel_size: int = 1, total: Optional[Memory] = None,
                   host_total: Optional[Memory] = None) -> MemoryProfile:
    """Measure, on the running backend, what the engine needs besides the KV cache."""
    device = next(iter(kv_cache.k.devices()))
    total = total or device_memory(device)
    host_total = host_total or process_memory("MemTotal")
    peak = measure_peak_bytes(forward, graphdef, params, kv_cache, num_tokens=max_num_batched_tokens,
                              num_rows=max_num_seqs, blocks_per_seq=blocks_per_seq,
                              block_size=block_size, impl=impl)
    source = "memory analysis of the forward at the largest token bucket"
    if peak is None:
        peak, source = analytic_peak_bytes(model_config, max_num_batched_tokens, max_num_seqs), "analytic bound"
    return MemoryProfile(total_bytes=total.bytes, source=total.source, weights_bytes=placed_bytes(params),
                         peak_bytes=peak, block_bytes=block_bytes_of(model_config, block_size, tensor_parallel_size),
                         host_total_bytes=host_total.bytes, peak_source=source,
                         tensor_parallel_size=tensor_parallel_size)


def _cache_like(kv, model_config, cap):
    """A zeroed cache of `cap`'s pool sizes placed as `kv` is (one device, or a mesh)."""
    import jax
    from jaxsched.cache.kv_cache import init_kv_cache
    mc = model_config
    shape = (mc.num_hidden_layers, cap.num_device_blocks + 1, cap.num_host_blocks + 1, cap.block_size,
             mc.num_key_value_heads, mc.head_dim)
    dtype = _np_dtype(mc.dtype)
    if isinstance(kv.k.sharding, jax.sharding.NamedSharding):
        from jaxsched.engine.sharding import init_sharded_kv_cache
        return init_sharded_kv_cache(kv.k.sharding.mesh, *shape, dtype=dtype)
    return init_kv_cache(*shape, dtype=dtype, device=next(iter(kv.k.devices())))


def size_engine(engine_args: dict, model_config, place, *, gpu_memory_utilization: float = 0.9,
                swap_space: float = 4, device_memory_bytes: Optional[int] = None,
                tensor_parallel_size: int = 1, attention_impl: str = "chunked"):
    """The engine's config and placed model with its KV cache sized from memory.

    `place(cap)` places the model and a cache of `cap` (sharding.place_model) and returns
    (graphdef, params, forward, kv, place_state). When `engine_args` give both block counts
    this is that call and nothing more; else the model is placed with a one-block cache, the
    weights and the largest step's working memory are measured, `plan_cache` chooses the
    counts, and a cache of those is made in the same placement. `device_memory_bytes`
    replaces the measured device memory (planning for another device; tests).
    Returns (SchedulerConfig, CachePlan, (graphdef, params, forward, kv, place_state)).
    """
    import jax

    from jaxsched.core.config import SchedulerConfig

    args = dict(engine_args)
    context = model_config.max_position_embeddings
    explicit_len = args.pop("max_model_len", None)
    length = explicit_len or default_max_model_len(context, jax.default_backend())
    args.setdefault("max_num_batched_tokens", max(512, args.get("max_num_seqs", 16)))
    sized = "num_device_blocks" not in args or "num_host_blocks" not in args
    if not sized:
        config = SchedulerConfig(**args, max_model_len=length)
        plan = plan_cache(None, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
                          context_len=context, max_model_len=length,
                          num_device_blocks=config.num_device_blocks, num_host_blocks=config.num_host_blocks,
                          gpu_memory_utilization=gpu_memory_utilization, swap_space=swap_space)
        _log(plan)
        return config, plan, place(config.capacity())
    probe = SchedulerConfig(**dict(args, num_device_blocks=args.get("num_device_blocks", 1),
                                   num_host_blocks=args.get("num_host_blocks", 0)), max_model_len=length)
    probe = dataclasses.replace(probe, num_device_blocks_capacity=None, num_host_blocks_capacity=None)
    graphdef, params, forward, kv, place_state = place(
        dataclasses.replace(probe.capacity(), num_device_blocks=1, num_host_blocks=0))
    total = Memory(device_memory_bytes, "injected device_memory_bytes") if device_memory_bytes else None
    profile = profile_engine(model_config, params, forward, graphdef, kv, block_size=probe.block_size,
                             max_num_batched_tokens=probe.max_num_batched_tokens,
                             max_num_seqs=probe.max_num_seqs, blocks_per_seq=probe.capacity().max_blocks_per_seq,
                             impl=attention_impl, tensor_parallel_size=tensor_parallel_size, total=total)
    plan = plan_cache(profile, gpu_memory_utilization=gpu_memory_utilization, swap_space=swap_space,
                      block_size=probe.block_size, max_num_seqs=probe.max_num_seqs, context_len=context,
                      max_model_len=explicit_len, default_max_model_len=length,
                      num_device_blocks=args.get("num_device_blocks"), num_host_blocks=args.get("num_host_blocks"))
    args.update(num_device_blocks=plan.num_device_blocks, num_host_blocks=plan.num_host_blocks)
    for key in ("num_device_blocks_capacity", "num_host_blocks_capacity"):
        if args.get(key) is not None and args[key] < args[key.removesuffix("_capacity")]:
            args.pop(key)                               # sized above an explicit capacity: it grows
    config = SchedulerConfig(**args, max_model_len=plan.max_model_len)
    kv = _cache_like(kv, model_config, config.capacity())     # the one-block probe cache goes
    _log(plan)
    return config, plan, (graphdef, params, forward, kv, place_state)


def _log(plan: CachePlan) -> None:
    for line in plan.log_lines():
        (log.warning if line.startswith("warning") else log.info)("%s", line)


def profile_model(model=None, *, dtype: str = "float32", device_memory_bytes: Optional[int] = None,
                  impl: str = "chunked"):
    """A function SchedulerConfig -> MemoryProfile for a model (a planner's `memory`).

    Loads and places the model once (one device) and measures, per distinct (block size,
    max_num_seqs, max_num_batched_tokens, max_model_len), the working memory as `LLM` does at
    start-up, so a planned row's block counts are the ones `LLM` chooses with the same knobs.
    """
    import functools

    from jaxsched.core.config import SchedulerConfig
    from jaxsched.engine.sharding import place_model
    from models.loader import load_weights

    model_config, tensors, _ = load_weights(model, dtype=dtype)
    probe = SchedulerConfig(num_device_blocks=1, num_host_blocks=0, max_model_len=16,
                            max_num_batched_tokens=16, max_num_seqs=1)
    graphdef, params, forward, kv, _ = place_model(model_config, tensors, None, probe.capacity(), 1,
                                                    None, impl)
    total = Memory(device_memory_bytes, "injected device_memory_bytes") if device_memory_bytes else None

    @functools.lru_cache(maxsize=None)
    def measure(block_size, max_num_seqs, max_num_batched_tokens, blocks_per_seq):
        return profile_engine(model_config, params, forward, graphdef, kv, block_size=block_size,
                              max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                              blocks_per_seq=blocks_per_seq, impl=impl, total=total)

    def memory(config) -> MemoryProfile:
        return measure(config.block_size, config.max_num_seqs, config.max_num_batched_tokens,
                       dataclasses.replace(config, num_device_blocks_capacity=None,
                                           num_host_blocks_capacity=None,
                                           max_blocks_per_seq=None).capacity().max_blocks_per_seq)
    memory.model_config = model_config
    return memory
