"""Scheduler configuration: the user-facing `SchedulerConfig` and the static `Capacity`.

A config splits in two. `Capacity` holds what fixes array shapes (slots, sequences per group,
blocks per sequence, pool sizes, block size, the chunked-prefill switch); it is hashable and
passed to `jax.jit` as a static argument, so one capacity compiles once. Everything else
(`max_num_seqs`, `max_num_batched_tokens`, `max_model_len`, the watermark, `delay_factor`, the
preemption mode and its cost model, the active number of device and host blocks) is a
per-run *limit* stored as arrays in the state, so a sweep or a differential test varies them
without recompiling.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from typing import Optional

from jaxsched.core.costs import DEFAULT_COSTS, PreemptionCosts

class PreemptionMode(enum.IntEnum):
    """Mode ids as stored in the limits; RECOMPUTE and SWAP also say how a group was
    preempted (SchedulerOutput.preempted, 0 for not at all). DEFAULT is vLLM's default
    (None: recompute a one-sequence group, swap a bigger one); COST is "auto", the cheaper
    of the two by the config's cost model (core/costs.py)."""
    DEFAULT = 0
    RECOMPUTE = 1
    SWAP = 2
    COST = 3


PREEMPTION_MODES = {None: PreemptionMode.DEFAULT, "recompute": PreemptionMode.RECOMPUTE,
                    "swap": PreemptionMode.SWAP, "auto": PreemptionMode.COST}
# Short names for the jitted code.
PREEMPT_DEFAULT, PREEMPT_RECOMPUTE, PREEMPT_SWAP, PREEMPT_COST = PreemptionMode


@dataclasses.dataclass(frozen=True)
class Capacity:
    """Static shapes of the scheduler state (hashable: a `jax.jit` static argument).

    Attributes:
      num_slots: request slots (sequence groups alive at once: waiting, running, swapped).
      max_seqs_per_group: the largest `n` a request may ask for.
      max_blocks_per_seq: block-table width.
      num_device_blocks: usable device blocks; the pool has one more, the null block 0.
      num_host_blocks: usable host blocks; likewise plus the null block.
      block_size: tokens per block.
      enable_chunked_prefill: chooses the walk order of SPEC A6 over A4.
      artificial_preemption: compiles the sequential running walk with random failures (A8).
      enable_prefix_caching: SPEC A10; compiles the cached block pools (core/cached_step.py)
        and their state fields in, off: neither exists.
      prefix_key_bits: width of the cache keys (64; tests make it tiny to force collisions).
    """
    num_slots: int
    max_seqs_per_group: int
    max_blocks_per_seq: int
    num_device_blocks: int
    num_host_blocks: int
    block_size: int
    enable_chunked_prefill: bool = False
    artificial_preemption: bool = False
    enable_prefix_caching: bool = False
    prefix_key_bits: int = 64


def _require(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise ValueError(f"SchedulerConfig.{field}: {message}")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Everything that configures a scheduler, with vLLM's names. Validated once.

    Attributes:
      block_size: tokens per KV block.
      num_device_blocks: KV blocks on the accelerator (vLLM's num_gpu_blocks).
      num_host_blocks: KV blocks of swap space in host memory (num_cpu_blocks).
      max_num_seqs: most sequences running in one step.
      max_num_batched_tokens: most tokens in one step (a hard limit here, SPEC B3).
      max_model_len: longest sequence; longer ones finish length-capped.
      enable_chunked_prefill: SPEC A6 instead of A4.
      preemption_mode: None or "default" (recompute for one sequence, swap for more), "recompute", "swap",
        or "auto" (per victim, whichever `preemption_costs` says is cheaper).
      preemption_costs: the cost model of "auto" (a core.costs.PreemptionCosts; a dict or a
        sequence of its five coefficients is converted). None: core.costs.DEFAULT_COSTS.
      delay_factor: SPEC A7.
      watermark: share of device blocks kept free at admission and swap-in.
      num_slots: request slots in the state (capacity; default 2 * max_num_seqs + 16).
      max_seqs_per_group: capacity for `n` (default 4).
      max_blocks_per_seq: block-table width (default: enough for max_model_len + 1 tokens).
      artificial_preemption: SPEC A8 test switch; `artificial_preemption_count` failures.
      enable_prefix_caching: SPEC A10, vLLM's automatic prefix caching (static: a capacity
        field; off compiles exactly the uncached scheduler).
      prefix_key_bits: width of the cache keys, 1..64 (64 is vLLM's width; tests make it tiny
        to force collisions, which make wrong shares as in vLLM).
      seed: PRNG seed for artificial preemption.
      num_device_blocks_capacity / num_host_blocks_capacity: pool sizes when a sweep wants
        room for more blocks than this run uses (default: the same numbers).
    """
    block_size: int = 16
    num_device_blocks: int = 256
    num_host_blocks: int = 256
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int = 512
    enable_chunked_prefill: bool = False
    preemption_mode: Optional[str] = None
    preemption_costs: Optional[PreemptionCosts] = None
    delay_factor: float = 0.0
    watermark: float = 0.01
    num_slots: Optional[int] = None
    max_seqs_per_group: int = 4
    max_blocks_per_seq: Optional[int] = None
    artificial_preemption: bool = False
    artificial_preemption_count: int = 500
    seed: int = 0
    num_device_blocks_capacity: Optional[int] = None
    num_host_blocks_capacity: Optional[int] = None
    enable_prefix_caching: bool = False
    prefix_key_bits: int = 64

    def __post_init__(self):
        for name in ("block_size", "num_device_blocks", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len", "max_seqs_per_group"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name,
                     f"must be a positive integer, got {value!r}")
        _require(isinstance(self.num_host_blocks, int) and self.num_host_blocks >= 0,
                 "num_host_blocks", f"must be an integer >= 0, got {self.num_host_blocks!r}")
        if self.preemption_mode == "default":            # the CLI's spelling of vLLM's None
            object.__setattr__(self, "preemption_mode", None)
        _require(isinstance(self.preemption_mode, (str, type(None)))
                 and self.preemption_mode in PREEMPTION_MODES, "preemption_mode",
                 f"must be None or 'default', 'recompute', 'swap' or 'auto', got {self.preemption_mode!r}")
        if self.preemption_costs is not None:
            try:
                costs = PreemptionCosts.coerce(self.preemption_costs)
            except (TypeError, ValueError) as e:
                raise ValueError(f"SchedulerConfig.preemption_costs: {e}") from None
            object.__setattr__(self, "preemption_costs", costs)
        _require(isinstance(self.delay_factor, (int, float)) and self.delay_factor >= 0,
                 "delay_factor", f"must be >= 0, got {self.delay_factor!r}")
        _require(isinstance(self.watermark, (int, float)) and 0 <= self.watermark < 1,
                 "watermark", f"must be in [0, 1), got {self.watermark!r}")
        _require(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
                 f"must be >= max_num_seqs ({self.max_num_seqs}) so every running sequence can "
                 f"decode, got {self.max_num_batched_tokens}")
        if self.num_slots is not None:
            _require(isinstance(self.num_slots, int) and self.num_slots >= 1, "num_slots",
                     f"must be a positive integer, got {self.num_slots!r}")
        if self.max_blocks_per_seq is not None:
            _require(isinstance(self.max_blocks_per_seq, int) and self.max_blocks_per_seq >= 1,
                     "max_blocks_per_seq", f"must be a positive integer, got {self.max_blocks_per_seq!r}")
        for name, active in (("num_device_blocks_capacity", self.num_device_blocks),
                             ("num_host_blocks_capacity", self.num_host_blocks)):
            cap = getattr(self, name)
            if cap is not None:
                _require(isinstance(cap, int) and cap >= active, name,
                         f"must be an integer >= {active}, got {cap!r}")
        _require(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching",
                 f"must be True or False, got {self.enable_prefix_caching!r}")
        _require(isinstance(self.prefix_key_bits, int) and 1 <= self.prefix_key_bits <= 64,
                 "prefix_key_bits", f"must be an integer in 1..64, got {self.prefix_key_bits!r}")
        _require(self.artificial_preemption_count >= 0, "artificial_preemption_count",
                 f"must be >= 0, got {self.artificial_preemption_count}")

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_device_blocks)

    @property
    def preemption_mode_id(self) -> int:
        return PREEMPTION_MODES[self.preemption_mode]

    @property
    def costs(self) -> PreemptionCosts:
        """The cost model "auto" uses: `preemption_costs`, else the default."""
        return self.preemption_costs or DEFAULT_COSTS

    def capacity(self) -> Capacity:
        blocks = self.max_blocks_per_seq or math.ceil((self.max_model_len + 1) / self.block_size)
        return Capacity(
            num_slots=self.num_slots or 2 * self.max_num_seqs + 16,
            max_seqs_per_group=self.max_seqs_per_group,
            max_blocks_per_seq=blocks,
            num_device_blocks=self.num_device_blocks_capacity or self.num_device_blocks,
            num_host_blocks=self.num_host_blocks_capacity or self.num_host_blocks,
            block_size=self.block_size,
            enable_chunked_prefill=bool(self.enable_chunked_prefill),
            artificial_preemption=bool(self.artificial_preemption),
            enable_prefix_caching=self.enable_prefix_caching,
            prefix_key_bits=self.prefix_key_bits if self.enable_prefix_caching else 64,
        )
