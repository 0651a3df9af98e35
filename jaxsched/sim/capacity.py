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

import numpy as np

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


# The most steps `surely_alive` evaluates its sample budget at, times requests: its cost is
# one pass over the requests per step evaluated.
_BOUND_WORK = 2 * 10**7


def surely_alive(trace: Trace, configs: Sequence[SchedulerConfig]) -> int:
    """At least this many requests are alive at once, at some step, in every replay of
    `configs` on `trace`: a replay with fewer slots surely runs out, so it may start above.

    A request holds its slot from its arrival step until it finishes, and it cannot finish
    before it has sampled its tokens, one a step: min(max_tokens, max_model_len - prompt_len
    + 1) of them. Nor can every arrived request have finished: a step schedules at most
    max_num_seqs sequences, each sampling at most one token, and a request takes one
    scheduled sequence for its prompt and n for each later token. So at step t at least
    (requests arrived by t) - (the most of them that could have finished by t - 1: those
    old enough, fewest samples first, within max_num_seqs samples a step) are alive.
    Requests that some configuration may finish early (ignored: a prompt over a limit, n
    over max_num_seqs, or a group that may outgrow the device pool) are left out, so the
    bound holds for each configuration of the grid. Zero without requests.
    """
    reqs = trace.requests
    if not reqs or not configs:
        return 0
    col = lambda key: np.array([r[key] for r in reqs], np.int64)   # noqa: E731
    arrival, prompt, max_tokens, n = col("arrival_step"), col("prompt_len"), col("max_tokens"), col("n")
    max_model_len = min(c.max_model_len for c in configs)
    prompt_limit = min(min(c.max_model_len, c.max_num_batched_tokens) for c in configs)
    pool = min(c.num_device_blocks - c.watermark_blocks for c in configs)
    max_num_seqs = min(c.max_num_seqs for c in configs)
    block_size = min(c.block_size for c in configs)
    tokens = np.maximum(1, np.minimum(max_tokens, max_model_len - prompt + 1))
    # A group at its longest, every sequence with its own table and a block to grow into.
    largest = n * (-(-(prompt + max_tokens) // block_size) + 1)
    kept = (prompt <= prompt_limit) & (n <= max_num_seqs) & (largest < pool)
    arrival, tokens, n = arrival[kept], tokens[kept], n[kept]
    if not arrival.size:
        return 0
    gone = arrival + tokens                 # the first step at whose start it may have gone
    sorted_arrival = np.sort(arrival)
    # Old enough only (exact, at every step): arrived minus gone, at each step an arrival or
    # a departure changes it.
    steps = np.unique(np.concatenate([arrival, gone]))
    alive = np.searchsorted(sorted_arrival, steps, "right") - np.searchsorted(np.sort(gone), steps, "right")
    best = int(alive.max())
    # The sample budget as well, at arrival steps (where the count can rise), sampled evenly
    # when there are many: each a valid bound, so fewer of them only weaken the maximum.
    samples = 1 + n * (tokens - 1)
    by_samples = np.argsort(samples, kind="stable")
    samples, gone_s = samples[by_samples], gone[by_samples]
    arrivals = np.unique(arrival)
    count = max(1, min(arrivals.size, _BOUND_WORK // arrival.size))
    first = int(sorted_arrival[0])
    for t in arrivals[np.unique(np.linspace(0, arrivals.size - 1, count).astype(np.int64))]:
        old = gone_s <= t
        spent = np.cumsum(np.where(old, samples, 0))
        could_finish = int(np.count_nonzero(old & (spent <= max_num_seqs * (t - first))))
        best = max(best, int(np.searchsorted(sorted_arrival, t, "right")) - could_finish)
    return best


def window_exact(trace: Trace, configs: Sequence[SchedulerConfig]) -> bool:
    """May arrivals past a replay's slots wait outside them (a backlog behind the waiting
    queue, which vLLM's admission walk reaches only after every waiting request in a slot)
    in every one of `configs`? Not where a request is ignored on arrival (SPEC B6: n above
    max_num_seqs): it must finish at its arrival step, so it needs a slot whatever the queue."""
    return max(r["n"] for r in trace.requests) <= min(c.max_num_seqs for c in configs)


def replay_capacity(trace: Trace, configs: Sequence[SchedulerConfig], *, restarts: bool,
                    backlog: bool = False) -> dict:
    """The capacity to replay `trace` under each of `configs`.

    Every request may be alive at once, so a power of two of slots at least the number of
    requests holds any replay (`simulate` starts there, up to its START_SLOTS). A caller
    that restarts with twice the slots when more requests are alive than it has (`sweep`,
    `restarts=True`) starts from a guess instead: a large trace rarely has more than a few
    times max_num_seqs alive, and every slot costs each step; never below what the trace
    surely needs (`surely_alive`: a burst of arrivals), where a restart would only add a
    compile. With `backlog` (the caller keeps arrivals past its slots outside them, as
    `sweep`'s window does) the slots hold the running and swapped requests and the waiting
    ones the admission walk may reach, so the guess is max_num_seqs (at least 64): the
    running groups are at most that many, and fewer where the device pool or the token
    budget binds first, which leaves the rest of the slots to the swapped and the waiting.
    """
    cap = needed_capacity(trace, configs)
    cap["max_seqs_per_group"] = pow2(cap["max_seqs_per_group"])
    cap["max_blocks_per_seq"] = bucket(cap["max_blocks_per_seq"])
    cap["num_slots"] = pow2(len(trace.requests))
    if restarts:
        most = pow2(max(c.max_num_seqs for c in configs))
        if backlog:
            guess = max(64, most)
        else:
            guess = max(64, 2 * most, pow2(surely_alive(trace, configs)))
        cap["num_slots"] = min(cap["num_slots"], guess)
    return cap
