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
later wave. Every wave steps batches of the whole grid's shape (the runs of a wave and
drained padding), so they share one compiled chunk.

A run that does not answer for a configuration all the way may still answer for the start:
its decisions are the configuration's up to the first step whose tests would come out
otherwise. The configuration's own run then starts from the answering run's state at the
last chunk boundary before that step (`Resumes`): the blocks it holds are the same ids
(allocation hands out the lowest free ids, and it never held more than the smaller pool),
so the state is the configuration's own but for its limits. So the runs go in three waves:
the largest configuration of each group of comparable ones and mode (`roots`), then the
lines' largest, then the rest, each run starting as late as a run made before it allows.

Off under prefix caching (its evictions depend on B) and artificial preemption, where the
scheduler does not track slack.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxsched.core.config import SchedulerConfig

# The limits whose values one run can answer for; every other field must be equal.
ANSWERED = ("num_device_blocks", "max_num_seqs", "num_host_blocks", "preemption_mode")


def prunable(config: SchedulerConfig) -> bool:
    """Does the scheduler track slack for runs of this (static) kind?"""
    return not (config.enable_prefix_caching or config.artificial_preemption)


@functools.lru_cache(maxsize=4096)
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


def roots(configs: list[SchedulerConfig]) -> list[int]:
    """Indices of the runs to make before any other: of each group of configurations that
    may answer for one another (all but ANSWERED equal), of more than one, the largest
    (num_device_blocks, then max_num_seqs, then num_host_blocks) of each preemption mode.
    Every other of the group can start from one's state for as long as its tests have
    room; the modes' runs part at their first preemption, and run side by side."""
    count: dict = {}
    top: dict = {}
    for i, c in enumerate(configs):
        count[_others(c)] = count.get(_others(c), 0) + 1
        size, key = (c.num_device_blocks, c.max_num_seqs, c.num_host_blocks), (_others(c), c.preemption_mode)
        if key not in top or top[key][0] < size:
            top[key] = (size, i)
    return sorted(i for (rest, _), (_, i) in top.items() if count[rest] > 1)


def worth_it(configs: list[SchedulerConfig], first: list[int]) -> bool:
    """Is a second wave likely to save time? Only if the first is at most half the grid: a
    wave costs its longest shard's runs, so a first wave of most of the grid leaves too few
    runs to save (16 configurations of benchmarks/sweep.py: 11 in the first wave, 2 answered
    for, 8 resumed: no faster than one wave, 1.0-1.6 s against 1.05-1.2 s; 64 to 1024: 22 to
    262 first, 1.4-2.5x faster). Since the shard threads wait for their own chunks, waves cost
    less: forced, pruning runs those 16 in 0.68-0.77 s against 0.83-0.89, but grids where no
    run answers for another still lose to one wave (2 modes x 2 max_num_seqs x 4 small pools:
    0.95-1.0 s against 0.87-0.9; x 2 pools: 0.49-0.53 against 0.42-0.46), and which kind a
    small grid is shows only once its runs are made; so the rule stands."""
    return 0 < len(first) <= len(configs) // 2


def _tests_agree(blocks, seqs, run_blocks, run_seqs, same_pool, block_slack, seq_slack):
    """Would every block and sequence test of a run at (run_blocks, run_seqs), with this least
    slack, come out the same at (blocks, seqs)? `same_pool`: the same preemption mode and host
    pool, which matter only once a block test fails. Not checked here: that both ignore the
    same requests (n between the two max_num_seqs)."""
    return (((blocks == run_blocks) | ((block_slack >= 0) & (blocks >= run_blocks - block_slack)))
            & ((seqs == run_seqs) | ((seq_slack >= 0) & (seqs >= run_seqs - seq_slack)))
            & (same_pool | (block_slack >= 0)))


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
        lo, hi = np.minimum(s, c.max_num_seqs), np.maximum(s, c.max_num_seqs)
        # Requests with lo < n <= hi are ignored at one S and not at the other.
        same_ignored = np.searchsorted(n_values, hi, "right") == np.searchsorted(n_values, lo, "right")
        same_pool = np.array([m == c.preemption_mode for m in modes]) & (h == c.num_host_blocks)
        ok = same_ignored & _tests_agree(c.num_device_blocks, c.max_num_seqs, b, s, same_pool,
                                         block_slack[js], seq_slack[js])
        if ok.any():
            out[i] = int(js[np.argmax(ok)])
    return out


class Resumes:
    """Where each configuration not yet run can start: the latest chunk boundary of a run
    made before it up to which that run's decisions are its own, and that run's state there.

    A run's decisions are a configuration's through a chunk when every step of it passes
    the test of `answers` against the configuration's limits: so a pair stays good through
    chunk after chunk while the chunk's least slack allows, and stops at the arrival of the
    first request one of the two ignores (its n between their max_num_seqs). The host feeds
    each chunk's least slack of the runs being made (`feed`), keeps the state of a run at a
    boundary while it is some configuration's best start (`store`), and hands it out when
    that configuration's run begins (`start`).
    """

    def __init__(self, configs: list[SchedulerConfig], request_n, arrival_step, chunk: int):
        field = lambda name: np.array([getattr(c, name) for c in configs], np.int64)  # noqa: E731
        self.blocks, self.seqs, self.host = field("num_device_blocks"), field("max_num_seqs"), field("num_host_blocks")
        kinds: dict = {}
        self.mode = np.array([kinds.setdefault(c.preemption_mode, len(kinds)) for c in configs])
        groups: dict = {}
        self.group = np.array([groups.setdefault(_others(c), len(groups)) for c in configs])
        self.chunk = chunk
        n, arrival = np.asarray(request_n), np.asarray(arrival_step)
        # The chunk boundaries a pair of max_num_seqs values share: up to the first arrival of
        # a request ignored at one and not the other.
        values = np.unique(self.seqs)
        lo, hi = np.minimum.outer(values, values), np.maximum.outer(values, values)
        between = (n[None, None, :] > lo[..., None]) & (n[None, None, :] <= hi[..., None])
        shared = np.where(between, arrival[None, None, :], np.iinfo(np.int64).max).min(-1, initial=np.iinfo(np.int64).max)
        self._shared = np.where(lo == hi, np.inf, shared // chunk)     # [value, value] -> boundary
        self._value = {int(v): i for i, v in enumerate(values)}
        self.best: dict[int, tuple[int, int]] = {}      # configuration -> (boundary, run)
        self.snaps: dict[tuple[int, int], tuple] = {}    # (run, boundary) -> its state there

    def begin(self, runs, targets, prefix_slack=None):
        """A wave of `runs` (configuration indices) starts; `targets`, the configurations
        not yet made, may start from them. `prefix_slack`: {run: (block, seq)}, the least
        slack of the steps a run starts with (from the run it starts from)."""
        self.runs, self.targets = np.asarray(runs, np.int64), np.asarray(targets, np.int64)
        t, r = self.targets[:, None], self.runs[None, :]
        self.good = self.group[t] == self.group[r]
        index = np.vectorize(self._value.get, otypes=[np.int64])
        seq_t = index(self.seqs[self.targets]) if len(targets) else np.zeros(0, np.int64)
        self.last = self._shared[seq_t[:, None], index(self.seqs[self.runs])[None, :]]
        for j, (block, seq) in (prefix_slack or {}).items():
            col = int(np.nonzero(self.runs == j)[0][0])
            self._through(np.array([col]), np.array([block]), np.array([seq]))

    def _through(self, cols, block, seq):
        """Pairs (target, run cols) that stay good through a chunk of these least slacks."""
        t, r = self.targets[:, None], self.runs[cols][None, :]
        same_pool = (self.mode[t] == self.mode[r]) & (self.host[t] == self.host[r])
        self.good[:, cols] &= _tests_agree(self.blocks[t], self.seqs[t], self.blocks[r], self.seqs[r],
                                           same_pool, block[None, :], seq[None, :])
        return self.good[:, cols]

    def feed(self, cols, chunks, block, seq) -> list[tuple[int, int]]:
        """Runs `self.runs[cols]` made their chunks `chunks` (global indices) with these least
        slacks. Returns the (column, boundary) whose state some target now starts from best:
        the caller reads them and calls `store`."""
        if not len(self.targets) or not len(cols):
            return []
        good = self._through(np.asarray(cols), np.asarray(block), np.asarray(seq))
        boundary = np.asarray(chunks) + 1
        at = np.where(good & (boundary[None, :] <= self.last[:, cols]), boundary[None, :], 0)
        pick, reach = at.argmax(1), at.max(1)
        wanted = set()
        for i, target in enumerate(self.targets):
            if reach[i] > self.best.get(int(target), (0, -1))[0]:
                run = int(self.runs[cols[pick[i]]])
                self.best[int(target)] = (int(reach[i]), run)
                wanted.add((int(cols[pick[i]]), int(reach[i])))
        self._forget()      # the states no target starts from any more (once per chunk, not per store)
        return sorted(wanted)

    def store(self, col: int, boundary: int, state) -> None:
        """The state (any host value) of run column `col` at chunk `boundary`."""
        self.snaps[(int(self.runs[col]), boundary)] = state

    def start(self, target: int):
        """(first step, run it starts from, the stored state) of `target`, or None."""
        if target not in self.best:
            return None
        boundary, run = self.best[target]
        return boundary * self.chunk, run, self.snaps[(run, boundary)]

    def drop(self, done) -> None:
        """Configurations run or answered for: their starts are not needed."""
        for target in done:
            self.best.pop(int(target), None)
        self._forget()

    def _forget(self) -> None:
        """Drop the stored states that are no configuration's best start."""
        keep = {(run, b) for b, run in self.best.values()}
        self.snaps = {k: v for k, v in self.snaps.items() if k in keep}
