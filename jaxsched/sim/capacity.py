"""Static sizes for replaying a trace: the one heuristic behind `simulate` and `sweep`.

A replay's capacity (SchedulerConfig's num_slots, max_seqs_per_group, max_blocks_per_seq,
num_device_blocks_capacity, num_host_blocks_capacity) fixes the compiled shapes. Decisions
do not depend on it as long as it holds the replay, so it is sized from the trace: as small
as holds every run, rounded up (to powers of two, or to `bucket`'s steps where a wider shape
costs every step) so that traces of nearby sizes share a compiled step.
"""
from __future__ import annotations

import math
from typing import Sequence

from jaxsched.core.config import SchedulerConfig
from jaxsched.sim.trace import Trace


def pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def bucket(x: int) -> int:
    """The smallest m * 2**k >= x with m in 4..7 (x itself up to 8): 16, 20, 24, 28, 32, 40,
    ... A block table's width costs every step (benchmarks/sweep_slots.py: twice the blocks
    a sequence, 1.16x a step at 128 slots), so such shapes round up by at most a quarter,
    not to a power of two."""
    if x <= 8:
        return max(1, x)
    k = x.bit_length() - 3                  # x in [4 * 2**k, 8 * 2**k)
    return -(-x // (1 << k)) << k


def longest_sequence(trace: Trace, configs: Sequence[SchedulerConfig]) -> int:
    """The most tokens a block table must map in any run: a sequence stops at max_model_len
    and holds one more slot for the token being appended; an over-long prompt is ignored,
    but its length still bounds the table."""
    reqs = trace.requests
    longest = max((r["prompt_len"] + r["max_tokens"] for r in reqs), default=0)
    return max([max((r["prompt_len"] for r in reqs), default=0)]
               + [min(longest, c.max_model_len) + 1 for c in configs])


def needed_capacity(trace: Trace, configs: Sequence[SchedulerConfig]) -> dict:
    """The smallest value of each capacity field that holds every run of `configs` on `trace`
    (num_slots: 1, since a replay that restarts on overflow needs only one to begin)."""
    return {
        "num_device_blocks_capacity": max(c.num_device_blocks for c in configs),
        "num_host_blocks_capacity": max(c.num_host_blocks for c in configs),
        "max_seqs_per_group": max((r["n"] for r in trace.requests), default=1),
        "max_blocks_per_seq": math.ceil(longest_sequence(trace, configs) / trace.scheduler_config.block_size),
        "num_slots": 1,
    }


def replay_capacity(trace: Trace, configs: Sequence[SchedulerConfig], *, restarts: bool) -> dict:
    """The capacity to replay `trace` under each of `configs`.

    Every request may be alive at once, so a power of two of slots at least the number of
    requests holds any replay (`simulate` starts there, up to its START_SLOTS). A caller
    that restarts with twice the slots when more requests are alive than it has (`sweep`,
    `restarts=True`) starts from a guess instead: a large trace rarely has more than a few
    times max_num_seqs alive, and every slot costs each step.
    """
    cap = needed_capacity(trace, configs)
    cap["max_seqs_per_group"] = pow2(cap["max_seqs_per_group"])
    cap["max_blocks_per_seq"] = bucket(cap["max_blocks_per_seq"])
    cap["num_slots"] = pow2(len(trace.requests))
    if restarts:
        cap["num_slots"] = min(cap["num_slots"], max(64, 2 * pow2(max(c.max_num_seqs for c in configs))))
    return cap
