"""Which configurations of a sweep one run answers for, exactly, without running them.

A run's decisions depend on num_device_blocks (B) and max_num_seqs (S) only through the
scheduler's tests against them: each block test (can_allocate, can_append_slots,
can_swap_in, NEVER) compares B - int(watermark * B) or B with what is used and needed, each
sequence test compares S with the sequences scheduled, and a request with n > S is ignored
on arrival. Every step reports how much the closest test of each kind had to spare
(SchedulerOutput.block_slack, seq_slack; negative when one failed). So a run at (B, S)
whose tests all passed with at least b blocks and s sequences to spare makes the very same
decisions at any B' >= B - b and any S' >= S - s that ignores the same requests: every
test comes out the same, step after step. A larger B' or S' only adds to the spare.
preemption_mode and num_host_blocks matter only to a run that fails a block test: it
preempts (by mode, into the host pool), or SPEC B5 lets a lone prefill go on where it
would be recomputed. Such a configuration's row is the answering run's, its free-block
counts shifted by the difference in pool sizes.

Which runs to make first: every grid line's largest configuration (the largest B of each
(S, mode, host blocks), the largest S of each (B, mode, host blocks), other limits equal),
as the one most likely to spare. Its answers save the runs below it; the rest run in a
second wave. Both waves step batches of the whole grid's shape (the runs of a wave and
drained padding), so they share one compiled chunk.

Off under prefix caching (its evictions depend on B) and artificial preemption, where the
scheduler does not track slack.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jaxsched.core.config import SchedulerConfig

# The limits whose values one run can answer for; every other field must be equal.
ANSWERED = ("num_device_blocks", "max_num_seqs", "num_host_blocks", "preemption_mode")


def prunable(config: SchedulerConfig) -> bool:
    """Does the scheduler track slack for runs of this (static) kind?"""
    return not (config.enable_prefix_caching or config.artificial_preemption)


def _others(config: SchedulerConfig) -> tuple:
    """The fields that must be equal for one run to answer for another."""
    return tuple(repr(getattr(config, f.name)) for f in dataclasses.fields(config)
                 if f.name not in ANSWERED)


def first_wave(configs: list[SchedulerConfig]) -> list[int]:
    """Indices of the configurations to run first: the largest of each line of more than one
    (see the module); none when no two configurations share a line."""
    top: dict = {}
    for i, c in enumerate(configs):
        rest = _others(c)
        for line, size in (((rest, "B", c.max_num_seqs, c.preemption_mode, c.num_host_blocks),
                            (c.num_device_blocks, c.max_num_seqs)),
                           ((rest, "S", c.num_device_blocks, c.preemption_mode, c.num_host_blocks),
                            (c.max_num_seqs, c.num_device_blocks))):
            count, best = top.get(line, (0, None))
            if best is None or size > best[0]:
                best = (size, i)
            top[line] = (count + 1, best)
    return sorted({best[1] for count, best in top.values() if count > 1})


def worth_it(configs: list[SchedulerConfig], first: list[int]) -> bool:
    """Is a second wave likely to save time? Only if the first is at most half the grid: a
    wave costs its longest shard's runs, so a first wave of most of the grid leaves too few
    runs to save (16 configurations of benchmarks/sweep.py: 11 in the first wave, 2 answered
    for, 1.3x slower than one wave; 64 to 1024: 22 to 262 first, 1.4-1.6x faster)."""
    return 0 < len(first) <= len(configs) // 2


def answers(configs: list[SchedulerConfig], ran: list[int], block_slack, seq_slack,
            request_n) -> dict[int, int]:
    """{configuration index: index into `ran`} for the configurations not in `ran` that a
    run of `ran` answers for. `block_slack`, `seq_slack` (int[len(ran)]) are each run's
    least spare over all its steps, `request_n` every request's n."""
    n_values = np.unique(np.asarray(request_n))
    ran_set = set(ran)
    by_others: dict = {}
    for j, i in enumerate(ran):
        by_others.setdefault(_others(configs[i]), []).append(j)
    field = lambda name, js: np.array([getattr(configs[ran[j]], name) for j in js])  # noqa: E731
    groups = {k: (np.array(js), field("num_device_blocks", js), field("max_num_seqs", js),
                  field("num_host_blocks", js), [configs[ran[j]].preemption_mode for j in js])
              for k, js in by_others.items()}
    block_slack, seq_slack = np.asarray(block_slack), np.asarray(seq_slack)
    out = {}
    for i, c in enumerate(configs):
        group = None if i in ran_set else groups.get(_others(c))
        if group is None:
            continue
        js, b, s, h, modes = group
        b_ok = (b == c.num_device_blocks) | ((block_slack[js] >= 0)
                                             & (c.num_device_blocks >= b - block_slack[js]))
        lo, hi = np.minimum(s, c.max_num_seqs), np.maximum(s, c.max_num_seqs)
        # Requests with lo < n <= hi are ignored at one S and not at the other.
        same_ignored = np.searchsorted(n_values, hi, "right") == np.searchsorted(n_values, lo, "right")
        s_ok = (s == c.max_num_seqs) | ((seq_slack[js] >= 0) & (c.max_num_seqs >= s - seq_slack[js])
                                        & same_ignored)
        same_mode = np.array([m == c.preemption_mode for m in modes]) & (h == c.num_host_blocks)
        ok = b_ok & s_ok & (same_mode | (block_slack[js] >= 0))
        if ok.any():
            out[i] = int(js[np.argmax(ok)])
    return out
