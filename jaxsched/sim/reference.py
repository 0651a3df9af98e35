"""A plain, mutable Python reference of jaxsched's scheduler: the oracle for differential tests.

Pure Python (numpy for the float32 cost comparison; jax only for SPEC A8's draws, imported
when artificial preemption first needs one), meant to be read as a statement of the semantics.

Written for clarity, straight from SPEC.md part A (vLLM 0.5.3's V0 scheduler with the "v1"
block manager) and part B (where jaxsched does better). Queues are deques of `SequenceGroup`
objects and block tables are Python lists; nothing here is fast or jittable.

    scheduler = ReferenceScheduler(SchedulerConfig(...))
    scheduler.add_request("q0", prompt_len=100, max_tokens=8, n=1, arrival_time=0.0)
    out = scheduler.schedule(now=0.0)          # decisions only
    finished = scheduler.process_outputs(out)  # the model-free engine: one token per sequence

`simulate_reference(trace)` replays a `jaxsched simulate` trace and returns its output dict.

With `enable_prefix_caching` (SPEC A10) both pools are `CachedBlockPool`s, vLLM 0.5.3's
CachedBlockAllocator with its evictor; docs/prefix-caching-notes.md states the semantics.

A group's prefill is one counter (SPEC B, decision 1): while `prefill_done < prefill_total`
the group is a (partial) prefill; the step that completes it samples one token per sequence
(forking a fresh group into `n` first); after that every live sequence decodes one token a
step. A fresh group's prefill_total is its prompt, a recomputed one's its prompt + outputs.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import OrderedDict, deque

import numpy as np

from jaxsched.core.costs import (DEFAULT_COSTS, PreemptionCosts, recompute_seconds, reusable_blocks,
                                 swap_seconds)

FINISHED_LENGTH_CAPPED = "finished_length_capped"
FINISHED_STOPPED = "finished_stopped"  # never reached in replay: no sequence samples EOS
FINISHED_IGNORED = "finished_ignored"
FINISHED_ABORTED = "finished_aborted"
RECOMPUTE, SWAP, AUTO = "recompute", "swap", "auto"  # preemption modes
OK, LATER, NEVER = "ok", "later", "never"  # vLLM's AllocStatus
ARTIFICIAL_PREEMPTION_PROB = 0.5
ARTIFICIAL_PREEMPTION_MAX_CNT = 500
SAMPLED_TOKEN = 1  # the token every sequence samples in trace replay (SPEC A10)
NEVER_ACCESSED = -1.0  # vLLM's DEFAULT_LAST_ACCESSED_TIME

ADMITTED, RUNNING, SWAPPED = "admitted", "running", "swapped"  # where a scheduled group came from
# SPEC B8: `running` after a step is [groups the running walk did not reach, in sorted order] +
# the scheduled groups in this order (walk order within each class): admitted, running decodes,
# running prefills, swapped-in decodes, swapped-in prefills.
RUNNING_ORDER = {(ADMITTED, True): 0, (RUNNING, False): 1, (RUNNING, True): 2,
                 (SWAPPED, False): 3, (SWAPPED, True): 4}
# The order in which vLLM lists the scheduled groups and processes their outputs (frees the
# finished ones): new prefills, running prefills, swapped-in prefills, running decodes,
# swapped-in decodes. With prefix caching the order of frees is the evictor's order.
OUTPUT_ORDER = {(ADMITTED, True): 0, (RUNNING, True): 1, (SWAPPED, True): 2,
                (RUNNING, False): 3, (SWAPPED, False): 4}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """The `config` object of a trace (tests/data/golden/README.md); unknown keys are dropped."""

    block_size: int
    num_device_blocks: int
    num_host_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = False
    preemption_mode: str | None = None  # None: RECOMPUTE for one sequence, SWAP for more
    preemption_costs: dict | None = None  # AUTO's cost model (core.costs.FIELDS); None: default
    delay_factor: float = 0.0
    watermark: float = 0.01
    step_time: float = 1.0
    max_steps: int = 5000
    artificial_preemption: bool = False
    seed: int = 0
    enable_prefix_caching: bool = False  # SPEC A10

    def __post_init__(self):
        if self.preemption_mode not in (None, RECOMPUTE, SWAP, AUTO):
            raise ValueError(f"bad preemption_mode {self.preemption_mode!r}")
        if min(self.block_size, self.num_device_blocks, self.max_num_seqs,
               self.max_num_batched_tokens, self.max_model_len) <= 0:
            raise ValueError(f"sizes and limits must be positive: {self}")

    @classmethod
    def from_dict(cls, config: dict) -> SchedulerConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names})


# ----------------------------------------------------------------------------- blocks


class BlockPool:
    """Reference-counted blocks; ids are an implementation detail, only counts are compared."""

    def __init__(self, num_blocks: int):
        self.ref_count = [0] * num_blocks
        self.free_ids = list(range(num_blocks - 1, -1, -1))  # a stack, lowest id on top

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self, ref_count: int = 1) -> int:
        block = self.free_ids.pop()
        self.ref_count[block] = ref_count
        return block

    def free(self, block: int) -> None:
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free_ids.append(block)


class CachedBlockPool:
    """SPEC A10: vLLM's CachedBlockAllocator with its LRU evictor, for one pool.

    Every block handed out has a key. `cached` maps the key of each block in use (ref count
    > 0) to it; a block whose count drops to 0 keeps its key and enters `evictor` (an ordered
    map, in the order blocks entered it) instead of being freed. Blocks are handed out in id
    order while never-used ones remain (ids below `num_used` have been used), then taken from
    the evictor. `num_free` counts never-used blocks plus the evictor's, as vLLM does.

    A key is a content key (`BlockManager.key`: a tuple) or, for a block allocated without
    one (a decode's new partial block), a fresh integer from `unkeyed`: ints never equal
    tuples, so such a block is never shared by content.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.num_used = 0
        self.ref_count = [0] * num_blocks
        self.key: list = [None] * num_blocks
        self.num_hashed_tokens = [0] * num_blocks
        self.last_accessed = [NEVER_ACCESSED] * num_blocks
        self.cached: dict = {}
        self.evictor: OrderedDict = OrderedDict()
        self.unkeyed = itertools.count()

    @property
    def num_free(self) -> int:
        return self.num_blocks - self.num_used + len(self.evictor)

    def contains(self, key) -> bool:
        return key in self.cached or key in self.evictor

    def allocate(self, key=None, num_hashed_tokens: int = 0) -> int:
        """The block with this key (in use: shared; in the evictor: taken back), else a
        never-used block, else the evictor's victim; it gets the key."""
        if key is None:
            key = next(self.unkeyed)
        if key in self.evictor:
            block = self.evictor.pop(key)
        elif key in self.cached:
            block = self.cached[key]
        else:
            block = self._fresh_block()
            self.key[block], self.num_hashed_tokens[block] = key, num_hashed_tokens
        self.cached[key] = block
        self.ref_count[block] += 1
        return block

    def _fresh_block(self) -> int:
        if self.num_used < self.num_blocks:
            self.num_used += 1
            return self.num_used - 1
        return self.evict()

    def evict(self) -> int:
        """vLLM's LRUEvictor.evict: start at the oldest entry and walk on while the next
        block was not accessed later than the current choice, switching to a block that
        covers more tokens; stop at the first block accessed later."""
        if not self.evictor:
            raise RuntimeError("no free block to evict")  # callers check the free count
        entries = iter(self.evictor.values())
        victim = next(entries)
        for block in entries:
            if self.last_accessed[victim] < self.last_accessed[block]:
                break
            if self.num_hashed_tokens[victim] < self.num_hashed_tokens[block]:
                victim = block
        del self.evictor[self.key[victim]]
        return victim

    def free(self, block: int) -> None:
        assert self.ref_count[block] > 0, f"double free of block {block}"
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            key = self.key[block]
            del self.cached[key]
            self.evictor[key] = block

    def update_key(self, key, block: int) -> None:
        """A block in use gets a new key (a decode filled it: SPEC A10's promotion)."""
        assert not self.contains(key)
        del self.cached[self.key[block]]
        self.key[block] = key
        self.cached[key] = block

    def access(self, block: int, now: float) -> None:
        self.last_accessed[block] = now


class Sequence:
    """One sample. `block_table` holds device ids while running, host ids while swapped.

    `prompt_ids` (a tuple) is only read by prefix caching's keys; every output token is
    SAMPLED_TOKEN."""

    def __init__(self, prompt_len: int, output_len: int = 0, prompt_ids: tuple | None = None):
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.prompt_ids = tuple(range(prompt_len)) if prompt_ids is None else prompt_ids
        self.block_table: list[int] = []
        self.finished = False

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.output_len


class SequenceGroup:
    """A request: one prompt and `n` samples; one sequence until its prompt step forks it."""

    def __init__(self, request_id: str, prompt_len: int, max_tokens: int, n: int,
                 arrival_time: float, prompt_token_ids=None):
        self.request_id, self.arrival_time = request_id, arrival_time
        self.prompt_len, self.max_tokens, self.n = prompt_len, max_tokens, n
        prompt_ids = None if prompt_token_ids is None else tuple(prompt_token_ids)
        assert prompt_ids is None or len(prompt_ids) == prompt_len
        self.seqs = [Sequence(prompt_len, 0, prompt_ids)]
        self.prefill_done, self.prefill_total = 0, prompt_len
        self.status: str | None = None  # a FINISHED_* status once finished
        self.finish_step: int | None = None
        self.num_preemptions = 0

    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]

    @property
    def num_live_seqs(self) -> int:
        return sum(not s.finished for s in self.seqs)

    def max_running_seqs(self) -> int:
        """vLLM's get_max_num_running_seqs: `n` before the fork, else the unfinished seqs."""
        return self.n if self.n > len(self.seqs) else self.num_live_seqs

    def is_prefill(self) -> bool:
        return self.prefill_done < self.prefill_total

    @property
    def remaining_prefill(self) -> int:
        return self.prefill_total - self.prefill_done

    def is_multi(self) -> bool:
        """Holds more than one live sequence: recomputing it is SPEC B1's multi recompute."""
        return self.num_live_seqs > 1

    @property
    def num_output_tokens(self) -> int:
        return self.seqs[0].output_len  # in replay every sequence has as many


def multi_recompute_layout(group: SequenceGroup, block_size: int) -> tuple[int, int, int]:
    """(shared blocks, footprint blocks, prefill_total) of a recomputed forked group (B1).

    The prompt's P // bs full blocks (F tokens) are computed once and shared by every live
    sequence; each sequence's tokens past F are its own:

        seq 0: [ shared: F tokens, P // bs blocks ][ own: L_0 - F tokens ]
        seq 1: [          (same blocks)           ][ own: L_1 - F tokens ]
    """
    num_shared = group.prompt_len // block_size
    shared_tokens = num_shared * block_size
    lengths = [s.num_tokens for s in group.live_seqs()]
    footprint = num_shared + sum(math.ceil(n / block_size) - num_shared for n in lengths)
    return num_shared, footprint, shared_tokens + sum(n - shared_tokens for n in lengths)


class BlockManager:
    """vLLM's "v1" block manager (BlockSpaceManagerV1), plus SPEC B1's multi allocation.

    With `enable_prefix_caching` both pools are CachedBlockPools (SPEC A10): a prompt's
    blocks are taken by key, a decode that fills a block promotes it, swaps carry keys.
    """

    def __init__(self, config: SchedulerConfig):
        self.block_size = config.block_size
        self.num_device_blocks = config.num_device_blocks
        self.watermark_blocks = int(config.watermark * config.num_device_blocks)
        self.caching = config.enable_prefix_caching
        pool = CachedBlockPool if self.caching else BlockPool
        self.device = pool(config.num_device_blocks)
        self.host = pool(config.num_host_blocks)

    def key(self, seq: Sequence, index: int) -> tuple:
        """The content key of block `index` of `seq` (vLLM's hash_of_block, unhashed): the
        sequence's tokens up to that block's end (fewer for its last, partial block) as
        (prompt tokens, None) within the prompt, (whole prompt, output tokens) past it."""
        end = (index + 1) * self.block_size
        if end <= seq.prompt_len:
            return seq.prompt_ids[:end], None
        return seq.prompt_ids, (SAMPLED_TOKEN,) * min(end - seq.prompt_len, seq.output_len)

    def _allocate_keyed(self, seq: Sequence) -> list[int]:
        return [self.device.allocate(self.key(seq, i), (i + 1) * self.block_size)
                for i in range(math.ceil(seq.num_tokens / self.block_size))]

    def _alloc_status(self, need: int) -> str:
        """NEVER if `need` blocks do not fit an empty cache above the watermark.

        NOTE: that is vLLM's can_allocate test. vLLM's can_swap_in says NEVER only when need >
        num_device_blocks, so a group whose need is in (num_device_blocks - watermark_blocks,
        num_device_blocks] is LATER forever and blocks the swapped queue (in default mode all
        admission too) for good. jaxsched uses this one test for prompts, swap-in and B1
        re-admission, so such a group is ignored instead; vLLM never finishes those workloads,
        so nothing else changes.
        """
        if self.num_device_blocks - need < self.watermark_blocks:
            return NEVER
        return OK if self.device.num_free - need >= self.watermark_blocks else LATER

    def can_allocate(self, group: SequenceGroup) -> str:
        return self._alloc_status(math.ceil(group.seqs[0].num_tokens / self.block_size))

    def allocate(self, group: SequenceGroup) -> None:
        seq = group.seqs[0]
        if self.caching:
            seq.block_table = self._allocate_keyed(seq)
            return
        seq.block_table = [self.device.allocate()
                           for _ in range(math.ceil(seq.num_tokens / self.block_size))]

    def can_allocate_multi(self, group: SequenceGroup) -> str:
        """SPEC B1: the swap-in test over the footprint of a recomputed forked group."""
        _, footprint, _ = multi_recompute_layout(group, self.block_size)
        return self._alloc_status(footprint + group.num_live_seqs)

    def allocate_multi(self, group: SequenceGroup) -> None:
        """NOTE: with prefix caching every sequence takes its blocks by key, so the prompt's
        full blocks are shared as without caching and sequences with equal contents share
        the rest too (never more blocks than the footprint can_allocate_multi counted)."""
        live = group.live_seqs()
        if self.caching:
            for seq in live:
                seq.block_table = self._allocate_keyed(seq)
            return
        num_shared, _, _ = multi_recompute_layout(group, self.block_size)
        shared = [self.device.allocate(ref_count=len(live)) for _ in range(num_shared)]
        for seq in live:
            num_own = math.ceil(seq.num_tokens / self.block_size) - num_shared
            seq.block_table = shared + [self.device.allocate() for _ in range(num_own)]

    def can_append_slots(self, group: SequenceGroup) -> bool:
        return self.device.num_free >= group.num_live_seqs

    def append_slots(self, seq: Sequence) -> tuple[int, int] | None:
        """Room for the sequence's last token: a new block, or a copy-on-write (src, dst).

        With caching (A10), a last block that this token fills is promoted: it takes the
        block already holding its full key if there is one (its own is released), else it
        gets that key; a new block (also a copy-on-write's) gets the full key when the
        sequence's last block is full, else a fresh unshared key."""
        table = seq.block_table
        if len(table) < math.ceil(seq.num_tokens / self.block_size):
            table.append(self._allocate_last(seq))
            return None
        last = table[-1]
        if self.device.ref_count[last] == 1:
            if self.caching and self._last_block_full(seq):
                table[-1] = self._promote(seq, last)
            return None
        table[-1] = self._allocate_last(seq)
        self.device.free(last)
        return last, table[-1]

    def _last_block_full(self, seq: Sequence) -> bool:
        return seq.num_tokens % self.block_size == 0

    def _allocate_last(self, seq: Sequence) -> int:
        if not self.caching:
            return self.device.allocate()
        last = math.ceil(seq.num_tokens / self.block_size) - 1
        key = self.key(seq, last) if self._last_block_full(seq) else None
        return self.device.allocate(key, (last + 1) * self.block_size)

    def _promote(self, seq: Sequence, block: int) -> int:
        key = self.key(seq, len(seq.block_table) - 1)
        if self.device.contains(key):
            self.device.free(block)
            return self.device.allocate(key)
        self.device.update_key(key, block)
        return block

    def fork(self, parent: Sequence, child: Sequence) -> None:
        child.block_table = list(parent.block_table)
        for block in child.block_table:
            self.device.ref_count[block] += 1

    @staticmethod
    def unique_blocks(group: SequenceGroup) -> list[int]:
        return list(dict.fromkeys(b for s in group.live_seqs() for b in s.block_table))

    def can_swap_in(self, group: SequenceGroup) -> str:
        return self._alloc_status(len(self.unique_blocks(group)) + group.num_live_seqs)

    def can_swap_out(self, group: SequenceGroup) -> bool:
        return len(self.unique_blocks(group)) <= self.host.num_free

    def move(self, group: SequenceGroup, src: BlockPool, dst: BlockPool) -> list[tuple[int, int]]:
        """Swap in (host -> device) or out; a shared block moves once and stays shared."""
        mapping: dict[int, int] = {}
        for seq in group.live_seqs():
            for i, block in enumerate(seq.block_table):
                if block in mapping:
                    dst.ref_count[mapping[block]] += 1
                elif self.caching:  # the block keeps its key: dst shares or takes it back
                    mapping[block] = dst.allocate(src.key[block], src.num_hashed_tokens[block])
                else:
                    mapping[block] = dst.allocate()
                src.free(block)
                seq.block_table[i] = mapping[block]
        return list(mapping.items())

    def access(self, group: SequenceGroup, now: float) -> None:
        """A10: every block of a scheduled group's sequences is accessed at `now`."""
        if self.caching:
            for seq in group.live_seqs():
                for block in seq.block_table:
                    self.device.access(block, now)

    def free(self, group: SequenceGroup, pool: BlockPool) -> None:
        """NOTE: vLLM frees each sequence's blocks as a Python set (an order of object ids);
        here they are freed in block-table order. With caching that is the evictor's order."""
        for seq in group.seqs:
            for block in seq.block_table:
                pool.free(block)
            seq.block_table = []


# ----------------------------------------------------------------------------- scheduler


@dataclasses.dataclass
class ScheduledGroup:
    group: SequenceGroup
    num_tokens: int  # the prefill chunk, or 1 for a decode (also for a forked group)
    num_seqs: int  # live sequences (1 until the fork)
    is_prefill: bool
    source: str  # ADMITTED, RUNNING or SWAPPED


@dataclasses.dataclass
class SchedulerOutputs:
    scheduled: list[ScheduledGroup] = dataclasses.field(default_factory=list)
    preempted: list[tuple[SequenceGroup, str]] = dataclasses.field(default_factory=list)
    swapped_out: list[SequenceGroup] = dataclasses.field(default_factory=list)
    swapped_in: list[SequenceGroup] = dataclasses.field(default_factory=list)
    ignored: list[SequenceGroup] = dataclasses.field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Budget:
    """vLLM's SchedulingBudget, as plain counters.

    NOTE: around a failed append check vLLM also subtracts the *current* group's charge. Its
    tokens were not charged yet (a no-op); its sequences (charged up front in default mode)
    only matter to a later walk if nothing was preempted, which only B5a allows, and there the
    group is served after all: so the charge is simply kept.
    """

    token_budget: int
    max_num_seqs: int
    num_batched_tokens: int = 0
    num_curr_seqs: int = 0

    @property
    def remaining_tokens(self) -> int:
        return self.token_budget - self.num_batched_tokens

    def can_schedule(self, num_tokens: int, num_seqs: int) -> bool:
        return (self.num_batched_tokens + num_tokens <= self.token_budget
                and self.num_curr_seqs + num_seqs <= self.max_num_seqs)


class ReferenceScheduler:
    """jaxsched's scheduler as plain Python: `schedule(now)`, then `process_outputs(out)`."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.block_manager = BlockManager(config)
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()
        self.swapped: deque[SequenceGroup] = deque()
        self.prev_time, self.prev_prompt, self.last_prompt_latency = 0.0, False, 0.0  # A7
        self.num_schedule_calls = 0  # artificial preemption (A8): the step index of the draws
        self.artificial_preempt_cnt = ARTIFICIAL_PREEMPTION_MAX_CNT
        self._num_append_checks = 0
        self._draw = None

    def add_request(self, request_id: str, prompt_len: int, max_tokens: int, n: int = 1,
                    arrival_time: float = 0.0, prompt_token_ids=None) -> SequenceGroup:
        """Queue a request at the tail of `waiting`. Without `prompt_token_ids` the prompt is
        0 .. prompt_len - 1 (only prefix caching reads it).

        SPEC B6: a request with n > max_num_seqs comes back FINISHED_IGNORED and is never
        queued (the caller sets its finish_step).
        """
        group = SequenceGroup(request_id, prompt_len, max_tokens, n, arrival_time,
                              prompt_token_ids)
        if n > self.config.max_num_seqs:
            group.status = FINISHED_IGNORED
        else:
            self.waiting.append(group)
        return group

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Remove the group from whichever queue holds it and free its device and host blocks."""
        bm = self.block_manager
        for queue, pool in ((self.waiting, None), (self.running, bm.device),
                            (self.swapped, bm.host)):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    if pool is not None:
                        bm.free(group, pool)
                    for seq in group.seqs:
                        seq.finished = True
                    group.status = FINISHED_ABORTED
                    return group
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # -- one step

    def schedule(self, now: float) -> SchedulerOutputs:
        """Decide one step: the three walks in the order of SPEC A4 (default) or A6 (chunked).

        NOTE: the queues are rebuilt only at the end, so the admission walk's delay gate reads
        `waiting` and `running` as they stood when the step began (SPEC A7).
        """
        out = SchedulerOutputs()
        budget = Budget(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        self._num_append_checks = 0
        not_reached = list(self.running)
        if self.config.enable_chunked_prefill:
            not_reached = self._schedule_running(out, budget)
            if not out.preempted:
                self._schedule_swapped(out, budget)
            self._schedule_prefills(out, budget, now)
        else:
            budget.num_curr_seqs = sum(g.max_running_seqs() for g in self.running)
            if not self.swapped:
                self._schedule_prefills(out, budget, now)
            if not out.scheduled:  # an admission makes the step prefill-only
                not_reached = self._schedule_running(out, budget)
                if not out.preempted:
                    self._schedule_swapped(out, budget)
        assert budget.num_batched_tokens <= self.config.max_num_batched_tokens  # B3

        # Recompute victims go to the front of waiting in reverse preemption order.
        self.waiting.extendleft(g for g, mode in out.preempted if mode == RECOMPUTE)
        served = sorted(out.scheduled, key=lambda s: RUNNING_ORDER[s.source, s.is_prefill])
        self.running = deque(not_reached + [s.group for s in served])
        self.swapped.extend(out.swapped_out)
        self.num_schedule_calls += 1
        for scheduled in out.scheduled:
            self.block_manager.access(scheduled.group, now)
        return out

    def _schedule_running(self, out: SchedulerOutputs, budget: Budget) -> list[SequenceGroup]:
        """Serve `running` oldest first, preempting from the tail; returns the groups not reached.

        A one-sequence group gets min(its uncomputed tokens, budget left) and 0 tokens stops
        the walk before its append check. A forked decode takes one token per live sequence
        with no budget check (A6), so it runs its append check and preemptions as in vLLM;
        only if it would then be scheduled past the budget is it left unscheduled at the head
        of `running`, and the walk stops there (B3).
        """
        queue = deque(sorted(self.running, key=lambda g: g.arrival_time))
        served_any = False
        while queue:
            group = queue[0]
            is_prefill, left = group.is_prefill(), budget.remaining_tokens
            if is_prefill or group.num_live_seqs == 1:
                num_tokens = min(group.remaining_prefill if is_prefill else 1, left)
            else:
                num_tokens = group.num_live_seqs
            if num_tokens <= 0:
                break
            queue.popleft()
            while not self._can_append_slots(group):
                if queue:
                    self._preempt(queue.pop(), out)  # the lowest priority: the tail
                elif (is_prefill and not served_any
                      and self._preemption_mode(group) == RECOMPUTE):
                    break  # B5: a lone partial prefill goes on with its allocated blocks
                else:
                    self._preempt(group, out)
                    return list(queue)
            if num_tokens > left:  # B3: never past the budget
                queue.appendleft(group)
                break
            self._append_slots(group, out)
            self._record(out, group, num_tokens if is_prefill else 1, is_prefill, RUNNING)
            budget.num_batched_tokens += num_tokens
            if self.config.enable_chunked_prefill:  # default mode charged every group up front
                budget.num_curr_seqs += group.max_running_seqs()
            served_any = True
        return list(queue)

    def _schedule_swapped(self, out: SchedulerOutputs, budget: Budget) -> None:
        """Swap groups back in, oldest first, until one does not fit (SPEC A4.5, B2, B5b)."""
        bm = self.block_manager
        queue = deque(sorted(self.swapped, key=lambda g: g.arrival_time))
        while queue:
            group = queue[0]
            status = bm.can_swap_in(group)
            if status == LATER:
                break
            if status == NEVER:
                queue.popleft()
                bm.free(group, bm.host)  # B2: its host blocks are not leaked
                self._ignore(group, out)
                continue
            is_prefill = group.is_prefill()
            if not is_prefill:
                num_tokens = group.num_live_seqs
            elif group.remaining_prefill > self.config.max_num_batched_tokens:  # B5b
                num_tokens = min(group.remaining_prefill, budget.remaining_tokens)
            else:  # not chunked: the whole rest of the prompt must fit
                num_tokens = group.remaining_prefill
            num_seqs = group.max_running_seqs()
            if num_tokens == 0 or not budget.can_schedule(num_tokens, num_seqs):
                break
            queue.popleft()
            out.blocks_to_swap_in += bm.move(group, bm.host, bm.device)
            self._append_slots(group, out)
            out.swapped_in.append(group)
            self._record(out, group, num_tokens if is_prefill else 1, is_prefill, SWAPPED)
            budget.num_batched_tokens += num_tokens
            budget.num_curr_seqs += num_seqs
        self.swapped = queue

    def _schedule_prefills(self, out: SchedulerOutputs, budget: Budget, now: float) -> None:
        """Admit groups from the head of `waiting` (SPEC A4.2, A6; B1 for forked recomputes)."""
        config, bm = self.config, self.block_manager
        if not self._passed_delay(now):
            return
        chunked = config.enable_chunked_prefill
        prompt_limit = (config.max_model_len if chunked
                        else min(config.max_model_len, config.max_num_batched_tokens))
        num_admitted = 0
        while self.waiting:
            group = self.waiting[0]
            left = budget.remaining_tokens
            multi = group.is_multi()
            if multi:  # B1: always chunked, no prompt limit, the swap-in test
                num_tokens = min(group.remaining_prefill, left)
                status = bm.can_allocate_multi(group)
            else:
                num_tokens = min(group.prefill_total, left) if chunked else group.prefill_total
                status = NEVER if num_tokens > prompt_limit else bm.can_allocate(group)
            if status == LATER:
                break
            if status == NEVER:
                self.waiting.popleft()
                self._ignore(group, out)
                continue
            num_seqs = group.max_running_seqs()
            if num_tokens == 0 or not budget.can_schedule(num_tokens, num_seqs):
                break
            self.waiting.popleft()
            (bm.allocate_multi if multi else bm.allocate)(group)
            self._record(out, group, num_tokens, True, ADMITTED)
            budget.num_batched_tokens += num_tokens
            budget.num_curr_seqs += num_seqs
            num_admitted += 1
        if num_admitted:
            self.prev_prompt = True

    def _passed_delay(self, now: float) -> bool:
        """vLLM's _passed_delay, evaluated once per admission walk (SPEC A7)."""
        if self.prev_prompt:
            self.last_prompt_latency = now - self.prev_time
        self.prev_time, self.prev_prompt = now, False
        if self.config.delay_factor > 0 and self.waiting:
            earliest_arrival = min(g.arrival_time for g in self.waiting)
            return (now - earliest_arrival > self.config.delay_factor * self.last_prompt_latency
                    or not self.running)
        return True

    # -- helpers of the walks

    def _can_append_slots(self, group: SequenceGroup) -> bool:
        if self.config.artificial_preemption:
            u = self._artificial_draw(self._num_append_checks)
            self._num_append_checks += 1
            if u < ARTIFICIAL_PREEMPTION_PROB and self.artificial_preempt_cnt > 0:
                self.artificial_preempt_cnt -= 1
                return False
        return self.block_manager.can_append_slots(group)

    def _artificial_draw(self, attempt: int) -> float:
        """u = uniform(fold_in(fold_in(PRNGKey(seed), schedule call index), check index))."""
        if self._draw is None:
            import jax

            def draw(seed, step_index, attempt):
                key = jax.random.fold_in(jax.random.PRNGKey(seed), step_index)
                return jax.random.uniform(jax.random.fold_in(key, attempt))

            self._draw = jax.jit(draw)
        return float(self._draw(self.config.seed, self.num_schedule_calls, attempt))

    def _append_slots(self, group: SequenceGroup, out: SchedulerOutputs) -> None:
        for seq in group.live_seqs():
            cow = self.block_manager.append_slots(seq)
            if cow is not None:
                out.blocks_to_copy.append(cow)

    def _preemption_mode(self, group: SequenceGroup) -> str:
        """SPEC A5, and B1: a swap that does not fit the free host blocks recomputes instead."""
        mode = self.config.preemption_mode
        if mode is None:
            mode = RECOMPUTE if group.max_running_seqs() == 1 else SWAP
        elif mode == AUTO:
            mode = SWAP if self._swap_is_cheaper(group) else RECOMPUTE
        return SWAP if mode == SWAP and self.block_manager.can_swap_out(group) else RECOMPUTE

    def _preempt(self, group: SequenceGroup, out: SchedulerOutputs) -> None:
        bm = self.block_manager
        mode = self._preemption_mode(group)
        if mode == SWAP:
            out.blocks_to_swap_out += bm.move(group, bm.device, bm.host)
            out.swapped_out.append(group)
        else:
            bm.free(group, bm.device)
            group.prefill_done = 0
            group.prefill_total = self._recompute_total(group)
        group.num_preemptions += 1
        out.preempted.append((group, mode))

    def _recompute_total(self, group: SequenceGroup) -> int:
        """Tokens a recompute prefills again (SPEC B1)."""
        return (multi_recompute_layout(group, self.block_manager.block_size)[2]
                if group.is_multi() else group.seqs[0].num_tokens)

    def _cached_tokens(self, group: SequenceGroup) -> int:
        """With prefix caching, the tokens of a recompute the evictor would give back (the
        group's reusable blocks whose K/V it computed): `auto` does not count them."""
        if not self.config.enable_prefix_caching:
            return 0
        bs = self.block_manager.block_size
        lead_len = group.live_seqs()[0].num_tokens
        computed = group.prefill_done if group.is_prefill() else lead_len
        blocks = reusable_blocks(group.prompt_len, lead_len, int(group.is_multi()), bs)
        return min(blocks, computed // bs) * bs

    def _swap_is_cheaper(self, group: SequenceGroup) -> bool:
        """AUTO: the swap of the group's unique blocks (out and back in) costs less than
        prefilling its tokens again. float32, in the jitted scheduler's order of operations."""
        costs = self.config.preemption_costs
        costs = DEFAULT_COSTS if costs is None else PreemptionCosts.coerce(costs)
        c = tuple(np.float32(x) for x in costs.coefficients)
        blocks = np.float32(len(self.block_manager.unique_blocks(group)))
        tokens = np.float32(self._recompute_total(group) - self._cached_tokens(group))
        return bool(swap_seconds(c, blocks) < recompute_seconds(c, tokens))

    def _ignore(self, group: SequenceGroup, out: SchedulerOutputs) -> None:
        for seq in group.seqs:
            seq.finished = True
        group.status = FINISHED_IGNORED
        out.ignored.append(group)

    @staticmethod
    def _record(out: SchedulerOutputs, group: SequenceGroup, num_tokens: int, is_prefill: bool,
                source: str) -> None:
        out.scheduled.append(
            ScheduledGroup(group, num_tokens, group.num_live_seqs, is_prefill, source))

    # -- the model-free engine step

    def process_outputs(self, out: SchedulerOutputs, step: int | None = None) -> list[SequenceGroup]:
        """Append one token per live sequence of each scheduled group whose prompt is complete.

        The prompt step of a fresh group samples `n` tokens and forks (the children share the
        parent's blocks); a B1 group gets one token per live sequence. A chunk that leaves the
        prompt incomplete samples nothing. Finished groups are freed and returned.
        """
        finished = []
        scheduled_groups = out.scheduled
        if self.config.enable_prefix_caching:  # frees fill the evictor in vLLM's order
            scheduled_groups = sorted(scheduled_groups,
                                      key=lambda s: OUTPUT_ORDER[s.source, s.is_prefill])
        for scheduled in scheduled_groups:
            group = scheduled.group
            if scheduled.is_prefill:
                group.prefill_done += scheduled.num_tokens
                if group.is_prefill():
                    continue
                parent = group.seqs[0]
                while len(group.seqs) < group.n:  # the prompt step forks
                    child = Sequence(parent.prompt_len, parent.output_len, parent.prompt_ids)
                    self.block_manager.fork(parent, child)
                    group.seqs.append(child)
            for seq in group.live_seqs():
                seq.output_len += 1
                if (seq.num_tokens > self.config.max_model_len
                        or seq.output_len == group.max_tokens):
                    seq.finished = True
            if not group.live_seqs():
                group.status, group.finish_step = FINISHED_LENGTH_CAPPED, step
                self.block_manager.free(group, self.block_manager.device)
                finished.append(group)
        if finished:
            self.running = deque(g for g in self.running if g.status is None)
            # Reported in the schedule's order whatever order freed them, so that caching
            # on and off give the same outputs where nothing is shared.
            position = {id(s.group): k for k, s in enumerate(out.scheduled)}
            finished.sort(key=lambda g: position[id(g)])
        return finished


# ----------------------------------------------------------------------------- trace replay


def simulate_reference(trace: dict, on_step=None) -> dict:
    """Replay a `jaxsched simulate` trace with no model; returns its output dict.

    `on_step(scheduler, out)`, if given, is called at the end of every step (tests use it to
    check invariants of the state).
    """
    config = SchedulerConfig.from_dict(trace["config"])
    scheduler = ReferenceScheduler(config)
    arrivals: dict[int, list[dict]] = {}
    for request in trace["requests"]:
        arrivals.setdefault(request["arrival_step"], []).append(request)
    last_arrival = max(arrivals, default=-1)
    groups: dict[str, SequenceGroup] = {}
    steps = []
    for step in range(config.max_steps + 1 if arrivals else 0):
        if step == config.max_steps:
            raise RuntimeError(f"the trace did not finish within max_steps={config.max_steps}")
        now = step * config.step_time
        ignored = []
        for request in arrivals.get(step, []):
            group = scheduler.add_request(request["id"], request["prompt_len"],
                                          request["max_tokens"], request.get("n", 1), now,
                                          request.get("prompt_token_ids"))
            groups[group.request_id] = group
            if group.status == FINISHED_IGNORED:  # SPEC B6: before the scheduler runs
                ignored.append(group)
        out = scheduler.schedule(now)
        num_free_device = scheduler.block_manager.device.num_free
        num_free_host = scheduler.block_manager.host.num_free
        ignored += out.ignored
        for group in ignored:
            group.finish_step = step
        finished = ignored + scheduler.process_outputs(out, step)
        steps.append({
            "step": step,
            "scheduled": [{"id": s.group.request_id, "num_tokens": s.num_tokens,
                           "num_seqs": s.num_seqs} for s in out.scheduled],
            "preempted": [{"id": g.request_id, "mode": mode} for g, mode in out.preempted],
            "swapped_out": [g.request_id for g in out.swapped_out],
            "swapped_in": [g.request_id for g in out.swapped_in],
            "ignored": [g.request_id for g in ignored],
            "finished": [g.request_id for g in finished],
            "num_free_device_blocks": num_free_device,
            "num_free_host_blocks": num_free_host,
        })
        if on_step is not None:
            on_step(scheduler, out)
        if step >= last_arrival and not scheduler.has_unfinished():
            break
    requests = {g.request_id: {"status": g.status, "finish_step": g.finish_step,
                               "num_output_tokens": g.num_output_tokens,
                               "num_preemptions": g.num_preemptions} for g in groups.values()}
    return {"steps": steps, "requests": requests,
            "num_preemptions": sum(g.num_preemptions for g in groups.values())}
