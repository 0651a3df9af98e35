"""The engine's running counters: what `LLM.stats()` reports (vLLM's `Stats` of a `StatLogger`).

Counted per step from the step's outputs (preemptions, block moves, tokens run, the peak
blocks in use), per token and per ignored request by the output processor, and timed per
step so that throughput leaves out the steps that compiled.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Optional

from jaxsched.core.config import PreemptionMode


@dataclasses.dataclass
class EngineStats:
    num_device_blocks: int
    num_host_blocks: int
    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    peak_device_blocks: int = 0
    peak_host_blocks: int = 0
    busy_seconds: float = 0.0
    compile_seconds: float = 0.0
    first_tokens: int = 0      # tokens of a first step that compiled (left out of tokens_per_s)

    def record_time(self, elapsed: float, compiled: Optional[float]) -> None:
        """One step took `elapsed` seconds; `compiled` is a lazily compiling step's running
        total of compile seconds (None: a step compiled whole by its first call)."""
        if compiled is not None:
            # A LazyStep times its compiling calls (each bucket's first); the rest is busy time.
            self.busy_seconds += max(elapsed - (compiled - self.compile_seconds), 0.0)
            self.compile_seconds = compiled
        elif self.counts["steps"] == 0:
            self.compile_seconds = elapsed     # the first step compiles the whole switch step
        else:
            self.busy_seconds += elapsed

    def record_step(self, out, compiles_lazily: bool) -> None:
        """Count one step's `StepOutput` (read back to the host)."""
        st = self.counts
        st["steps"] += 1
        st["preempted_recompute"] += int((out.preempted == PreemptionMode.RECOMPUTE).sum())
        st["preempted_swap"] += int((out.preempted == PreemptionMode.SWAP).sum())
        st["blocks_swapped_out"] += int(out.num_swap_out)
        st["blocks_swapped_in"] += int(out.num_swap_in)
        st["blocks_copied"] += int(out.num_copy)
        st["tokens_run"] += int(out.num_tokens)
        st["cached_prompt_tokens"] += int(out.num_cached_tokens)
        st["prefix_cache_queries"] += int(out.prefix_queried)
        st["prefix_cache_hits"] += int(out.prefix_hit)
        self.peak_device_blocks = max(self.peak_device_blocks,
                                      self.num_device_blocks - int(out.num_free_device_blocks))
        self.peak_host_blocks = max(self.peak_host_blocks,
                                    self.num_host_blocks - int(out.num_free_host_blocks))
        if st["steps"] == 1 and not compiles_lazily:
            self.first_tokens = int(out.has_token.sum())   # their step's time was the compile

    def prefix_cache_hit_rate(self) -> float:
        """Of the full prompt blocks that prefills looked up, the share found in the cache
        with their K/V ready (0 with caching off, as vLLM reports)."""
        st = self.counts
        return round(st["prefix_cache_hits"] / max(st["prefix_cache_queries"], 1), 4)

    def as_dict(self) -> dict:
        """`LLM.stats()`: the counters, throughput of the steps that compiled nothing, peaks."""
        st = self.counts
        elapsed = max(self.busy_seconds, 1e-9)
        return {
            "steps": st["steps"], "output_tokens": st["output_tokens"],
            "tokens_per_s": round((st["output_tokens"] - self.first_tokens) / elapsed, 1),
            "preempted_recompute": st["preempted_recompute"], "preempted_swap": st["preempted_swap"],
            "blocks_swapped_out": st["blocks_swapped_out"], "blocks_swapped_in": st["blocks_swapped_in"],
            "blocks_copied": st["blocks_copied"], "ignored": st["ignored"],
            "peak_device_blocks": self.peak_device_blocks, "peak_host_blocks": self.peak_host_blocks,
            "cached_prompt_tokens": st["cached_prompt_tokens"],
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate(),
            "engine_seconds": round(elapsed, 2), "compile_seconds": round(self.compile_seconds, 1),
        }
