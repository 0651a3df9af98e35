"""vLLM's three queue walks as prefix computations (see DESIGN-walks.md), and the queues'
shared slot order they walk in.

Every input is in walk order (index 0 is the head of the queue) and padded past `m`, the
number of real groups. A walk's outcome is a prefix of the queue (who is served), plus for
the running walk a suffix (who is preempted, tail first); cumulative sums find both without
a loop over groups. The sequential `running_walk_loop` is the same walk with vLLM's random
failed append checks (SPEC A8), where the order of draws truly matters.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxsched.core import batching
from jaxsched.core.block_pool import cummin, cumsum, exclusive_cumsum, first_true
from jaxsched.core.state import RUNNING, SWAPPED, WAITING, SchedulerState

BIG = 2**30          # a Python int: importing jaxsched must not start a JAX backend
UNTRACKED = -1       # the slack of a walk that does not track it: as if a test failed


class RunningWalk(NamedTuple):
    served: jax.Array          # bool[G]
    preempted: jax.Array       # bool[G]
    preempt_order: jax.Array   # int32[G], 0 = first preempted
    chunk: jax.Array           # int32[G] tokens scheduled (a decode reports 1)
    charged: jax.Array         # int32[G] tokens charged to the budget (k for a decode)
    block_slack: jax.Array     # int32[] see `running_walk`


class RunningInputs(NamedTuple):
    num_seqs: jax.Array        # k: running sequences, what can_append_slots needs free
    need: jax.Array            # blocks the append really takes (new blocks, copy-on-write)
    held: jax.Array            # unique device blocks preempting the group frees
    full: jax.Array            # tokens if fully served: rest of prefill, or k for a decode
    is_prefill: jax.Array      # bool: prompt not fully computed


def _walk_tokens(inp: RunningInputs, real: jax.Array, budget: jax.Array, full_before=None):
    """Per group: its chunk, its charge, and where the walk stops (SPEC A6, B3).

    A one-sequence group gets min(uncomputed tokens, budget left), and 0 stops the walk
    before its append check (`stop`). A forked decode takes its k tokens unchecked (A6), so
    one past the budget still runs its append check and preemptions, and only then stops
    the walk unscheduled (`over`). Returns (chunk, charged, stop, over).
    """
    if full_before is None:
        full_before = exclusive_cumsum(jnp.where(real, inp.full, 0))
    left = budget - full_before
    forked = ~inp.is_prefill & (inp.num_seqs > 1)
    chunk = jnp.where(inp.is_prefill, jnp.minimum(inp.full, left), 1)
    stop = real & ~forked & (jnp.minimum(chunk, left) <= 0)
    over = real & forked & (left < inp.num_seqs)
    charged = jnp.where(inp.is_prefill, chunk, inp.num_seqs)
    return chunk, charged, stop, over


def _visited(stop, over, m):
    """(groups append-checked, does the last of them stop the walk unscheduled?)"""
    s_stop, s_over = first_true(stop, m), first_true(over, m)
    over_hit = s_over < s_stop
    return jnp.where(over_hit, s_over + 1, s_stop), over_hit


def running_walk(inp: RunningInputs, m: jax.Array, free: jax.Array, budget: jax.Array,
                 block_bound: int | None = None, head_recomputes=True) -> RunningWalk:
    """SPEC A4.4 / A6 running walk with B3 and B5, loop-free (DESIGN-walks closed form).

    `block_bound` (static) bounds the sum of all `need` and `held`; it lets their prefix
    sums run in float32 (see `block_pool.cumsum`). `head_recomputes`: the head group, were
    it preempted after every group behind it, would be recomputed; only then does B5 let a
    lone partial prefill go on (by swap vLLM swaps it out, which finishes).

    `block_slack`: the fewest blocks any append check had to spare (free after the groups
    before it minus k), negative when one failed (then something is preempted, or B5's lone
    prefill goes on), BIG when none ran: with that many fewer free blocks the walk is the same.
    """
    g = inp.num_seqs.shape[0]
    pos = jnp.arange(g, dtype=jnp.int32)
    real = pos < m
    k = jnp.where(real, inp.num_seqs, 0)
    need = jnp.where(real, inp.need, 0)
    held = jnp.where(real, inp.held, 0)
    full = jnp.where(real, inp.full, 0)
    need_incl, held_incl = cumsum(jnp.stack([need, held]), axis=1, bound=block_bound)
    chunk, charged, stop, over = _walk_tokens(inp, real, budget, exclusive_cumsum(full))
    s, over_hit = _visited(stop, over, m)
    visited = pos < s
    x = free + held_incl[-1] - (need_incl - need) - k
    x_min = cummin(jnp.where(visited, x, BIG))
    reached = (visited & (held_incl <= x_min)).sum(dtype=jnp.int32)
    failed = reached < s
    lone_prefill = failed & (reached == 0) & inp.is_prefill[0] & head_recomputes   # SPEC B5
    # Fewest tail victims that let every visited group pass: the largest prefix P[i] <= min X.
    held_excl = jnp.concatenate([held_incl - held, held_incl[-1:]])
    bound = x_min[jnp.maximum(s - 1, 0)]
    bound = jnp.where(s > 0, bound, BIG)
    fits = (jnp.arange(g + 1) <= m) & (held_excl <= bound)
    first_victim = fits.sum(dtype=jnp.int32) - 1
    first_victim = jnp.where(failed, jnp.where(lone_prefill, 1, reached), first_victim)
    # A forked decode past the budget passed its check (and made its victims) but is not
    # scheduled: it stays at the head of `running` (B3).
    num_served = jnp.where(failed, jnp.where(lone_prefill, 1, reached), s - over_hit)
    preempted = real & (pos >= first_victim)
    # Before any preemption group i's check has x[i] - held_incl[-1] blocks to spare.
    return RunningWalk(served=pos < num_served, preempted=preempted,
                       preempt_order=jnp.where(preempted, m - 1 - pos, 0),
                       chunk=chunk, charged=charged,
                       block_slack=jnp.where(s > 0, bound - held_incl[-1], BIG).astype(jnp.int32))


def running_walk_loop(inp: RunningInputs, m: jax.Array, free: jax.Array, budget: jax.Array,
                      key: jax.Array, count: jax.Array, fail_prob: float = 0.5,
                      head_recomputes=True):
    """The running walk one group at a time, with artificial append failures (SPEC A8).

    The draw for the a-th append check of this walk is uniform(fold_in(key, a)). Returns the
    walk and the forced-failure counter left. `head_recomputes` as in `running_walk`.
    """
    g = inp.num_seqs.shape[0]
    pos = jnp.arange(g, dtype=jnp.int32)
    real = pos < m
    chunk, charged, stop, over = _walk_tokens(inp, real, budget)
    s, over_hit = _visited(stop, over, m)

    def cond(c):
        i, tail, *_ , done = c
        return ~done

    def body(c):
        i, tail, f, attempt, cnt, served, preempted, order, n_pre, done = c
        at_stop = (i >= tail) | (i >= s)
        over_here = over_hit & (i == s - 1)      # checked, then left unscheduled (B3)
        u = jax.random.uniform(jax.random.fold_in(key, attempt))
        forced = (u < fail_prob) & (cnt > 0)
        passes = ~forced & (f >= inp.num_seqs[i])
        victim_left = tail - 1 > i
        lone = ~passes & ~victim_left & (served.sum() == 0) & inp.is_prefill[i] & head_recomputes
        serve = ~at_stop & (passes | lone) & ~over_here
        take_tail = ~at_stop & ~passes & victim_left
        self_preempt = ~at_stop & ~passes & ~victim_left & ~lone
        v = jnp.where(take_tail, tail - 1, i)
        preempt = take_tail | self_preempt
        served = served.at[i].set(served[i] | serve)
        preempted = preempted.at[v].set(preempted[v] | preempt)
        order = order.at[v].set(jnp.where(preempt, n_pre, order[v]))
        f = f - jnp.where(serve, inp.need[i], 0) + jnp.where(preempt, inp.held[v], 0)
        return (i + serve.astype(jnp.int32), tail - take_tail.astype(jnp.int32), f,
                attempt + (~at_stop).astype(jnp.int32), cnt - (~at_stop & forced).astype(jnp.int32),
                served, preempted, order, n_pre + preempt.astype(jnp.int32),
                at_stop | self_preempt | (lone & serve) | (~at_stop & passes & over_here))

    zeros_b = jnp.zeros((g,), bool)
    init = (jnp.int32(0), m, free, jnp.int32(0), count, zeros_b, zeros_b,
            jnp.zeros((g,), jnp.int32), jnp.int32(0), m == 0)
    out = lax.while_loop(cond, body, init)
    served, preempted, order, cnt = out[5], out[6], out[7], out[4]
    # Slack is not tracked here (a forced failure is not a lack of blocks).
    return RunningWalk(served=served, preempted=preempted, preempt_order=order,
                       chunk=chunk, charged=charged, block_slack=jnp.int32(UNTRACKED)), cnt


class PrefixWalk(NamedTuple):
    served: jax.Array       # bool[G]
    skipped: jax.Array      # bool[G] ignored on the way (NEVER, prompt too long)
    chunk: jax.Array        # int32[G]
    block_slack: jax.Array  # int32[] see `prefix_walk`
    seq_slack: jax.Array    # int32[]


def prefix_walk(skip, test_need, consume, tokens, chunkable, seqs, m, free, watermark,
                token_left, seq_left) -> PrefixWalk:
    """The waiting or swapped walk: serve a prefix, ignoring skipped groups on the way.

    A group passes when its block test leaves `watermark` free (`test_need` against the free
    count after the groups before it took `consume`), it gets tokens (`chunkable`: as many
    as are left, else all of `tokens` must fit), and its sequences fit. The first failure
    stops the walk.

    `block_slack` and `seq_slack`: the least any group up to the first failure had to spare
    in its block test and its sequence test (negative when one failed, BIG when no group
    was tested). With that many fewer free blocks (or sequences left) every test up to the
    stop, the stop included, comes out the same, so the walk does (a sweep uses this to
    share one run between configurations, sim/sweep.py).
    """
    g = skip.shape[0]
    pos = jnp.arange(g, dtype=jnp.int32)
    real = pos < m
    cand = real & ~skip
    used_blocks, used_tokens, used_seqs = exclusive_cumsum(
        jnp.where(cand, jnp.stack([consume, tokens, seqs]), 0), axis=1)
    left = token_left - used_tokens
    chunk = jnp.where(chunkable, jnp.minimum(tokens, left), tokens)
    block_spare = free - used_blocks - test_need - watermark
    seq_spare = seq_left - used_seqs - seqs
    ok = (block_spare >= 0) & (chunk > 0) & (chunk <= left) & (seq_spare >= 0)
    stop = first_true(cand & ~ok, m)
    before = pos < stop
    tested = cand & (pos <= stop)
    least = lambda spare: jnp.min(jnp.where(tested, spare, BIG)).astype(jnp.int32)   # noqa: E731
    return PrefixWalk(served=cand & before, skipped=real & skip & before, chunk=chunk,
                      block_slack=least(block_spare), seq_slack=least(seq_spare))


class Queues(NamedTuple):
    """The three queues in one slot order: waiting, running, swapped, then idle slots.

    Waiting is in queue_key order, running and swapped in (arrival_time, queue_key) order;
    `pos` inverts `order`. Queue q occupies order[start[q] : start[q] + count[q]].
    """
    order: jax.Array     # int32[G]
    pos: jax.Array       # int32[G]
    start: tuple         # int32[] x 3
    count: tuple         # int32[] x 3

    def walk(self, q: int) -> jax.Array:
        """Slots of queue q in walk order, padded past its count with later slots."""
        g = self.order.shape[0]
        return jnp.take(self.order, jnp.clip(self.start[q] + jnp.arange(g), 0, g - 1))

    def to_slots(self, q: int, member: jax.Array, *values_w) -> list:
        """Walk-ordered values of queue q back in slot space (zero outside the queue)."""
        g = self.order.shape[0]
        at = jnp.clip(self.pos - self.start[q], 0, g - 1)
        return [jnp.where(member, jnp.take(v, at), jnp.zeros((), v.dtype)) for v in values_w]


def order_is_cached(state: SchedulerState):
    """(cached order, is it still sorted?) The order the previous step stored in the state
    is the queue order unless statuses, arrivals or keys changed it since (see `queues`)."""
    cached, ascending = _cached_order(state)
    return cached, ascending.all()


def _cached_order(state: SchedulerState):
    """(the order the state caches, `_ascending` of it)."""
    cached = jnp.clip(state.walk_order, 0, state.status.shape[0] - 1)
    return cached, _ascending(state, cached)


def _ascending(state: SchedulerState, order) -> jax.Array:
    """bool[G - 1]: is the key tuple of the slot at each position of `order` (int32[G])
    below the next one's? All of them: sorted, and (slots being distinct) a permutation, so
    the one order `_sorted_slots` would give."""
    g = order.shape[0]
    pairs = []
    # NOTE: checked in chunks of 512 pairs: as one kernel at 1024 slots, XLA's cost model
    # splits it across threads, and on 2 shared cores the hand-off costs more (up to 100 us)
    # than the whole check.
    for start in range(0, g - 1, 512):
        keys = _sort_keys(state, order[start:min(g, start + 513)])
        pairs.append(_lex_less([k[:-1] for k in keys], [k[1:] for k in keys]))
    return jnp.concatenate(pairs) if pairs else jnp.ones((0,), bool)


def _lex_less(a, b) -> jax.Array:
    """Elementwise: is the key tuple `a` below `b` in lexicographic order (keys broadcast)?"""
    less = a[-1] < b[-1]
    for x, y in zip(reversed(a[:-1]), reversed(b[:-1])):
        less = (x < y) | ((x == y) & less)
    return less


def _sort_keys(state: SchedulerState, slots):
    """(queue, arrival for running/swapped, queue_key, slot) of the given slots."""
    status = jnp.take(state.status, slots)
    queue = jnp.where(status == WAITING, 0, jnp.where(status == RUNNING, 1,
                                                      jnp.where(status == SWAPPED, 2, 3)))
    arrival = jnp.where((queue == 1) | (queue == 2), jnp.take(state.arrival_time, slots), 0.0)
    return queue, arrival, jnp.where(queue < 3, jnp.take(state.queue_key, slots), 0), slots


# Up to this many slots the order comes from counting, for each slot, the slots whose keys
# are smaller (one fused [G, G] comparison); above it from a sort.
RANK_BY_COMPARISON_UP_TO = 256


def _sorted_slots(keys) -> jax.Array:
    """int32[G]: the slots (the last key, distinct) in lexicographic order of `keys`.

    NOTE: XLA:CPU sorts through a comparator call per pair: at 128 slots with four keys the
    sort costs about 27 us in a loop of its own (14-24 us in a sweep's profile, the step's
    largest op), the comparison count and its scatter of G positions about 7 us. A whole
    sweep does not measurably gain (benchmarks/results/sweep_ab_4bcd673_*.md).
    """
    g = keys[-1].shape[0]
    if g > RANK_BY_COMPARISON_UP_TO:
        return lax.sort(keys, num_keys=len(keys))[-1]
    # Row i, column j: does slot j come before slot i?
    less = _lex_less([k[None, :] for k in keys], [k[:, None] for k in keys])
    rank = less.astype(jnp.float32).sum(axis=1).astype(jnp.int32)   # exact: G < 2**24
    return jnp.zeros((g,), jnp.int32).at[rank].set(keys[-1].astype(jnp.int32), mode="drop")


# A stale cached order of at least REPAIR_FROM_SLOTS slots, at most REPAIR_UP_TO of them out
# of place, is repaired (`_repaired`) instead of sorted again. On the general steps of a
# 500-request replay (CPU, benchmarks/results/queue_order.md) 89% start from a stale order and
# 95% of those are repaired: the order costs 78 / 77 / 178 us sorted at 256 / 512 / 1024
# slots, 44 / 63 / 113 us as it is; at 128 slots the repair saves nothing (35 us either way).
REPAIR_FROM_SLOTS = 256
REPAIR_UP_TO = 16


def _out_of_place(queue, ascending, counts) -> jax.Array:
    """bool[G], by position in a once-sorted order: slots that may have left their place.

    `queue` (int32[G]) is the queue of the slot at each position now, `ascending` (bool[G-1],
    `_ascending`) which neighbours are still in order, `counts` the queue sizes now. A slot
    outside the positions its queue now spans changed queues; both slots of a descending
    pair changed keys within one (a requeue reorders groups that arrived together).
    """
    g = queue.shape[0]
    bounds = jnp.stack([counts[0], counts[0] + counts[1], counts[0] + counts[1] + counts[2]])
    expected = (jnp.arange(g)[:, None] >= bounds[None, :]).sum(1, dtype=jnp.int32)
    descent = ~ascending
    return (queue != expected) | jnp.pad(descent, (0, 1)) | jnp.pad(descent, (1, 0))


def _repaired(keys, moved) -> jax.Array:
    """int32[G]: the slots re-ranked when at most REPAIR_UP_TO positions are `moved`.

    `keys` are the sort keys (`_sort_keys`, the slots last) at each position of an order
    that was sorted before some slots moved. The others keep their relative order, so this
    is the queue order when their keys kept theirs (`queues` checks it). A kept slot is
    preceded by the kept ones before it and the moved ones with smaller keys; a moved slot
    by every slot with a smaller key: G * REPAIR_UP_TO comparisons, not G * G.
    """
    g = moved.shape[0]
    pos = jnp.arange(g, dtype=jnp.int32)
    moved_before = exclusive_cumsum(moved, bound=g)
    at = jnp.full((REPAIR_UP_TO,), g, jnp.int32).at[jnp.where(moved, moved_before, REPAIR_UP_TO)].set(
        pos, mode="drop")                                    # positions of the moved slots
    real = at < g
    mine = [jnp.take(k, jnp.minimum(at, g - 1)) for k in keys]
    # Row p, column j: does moved slot j come before the slot at position p?
    less = _lex_less([k[None, :] for k in mine], [k[:, None] for k in keys])
    kept_rank = pos - moved_before + (less & real[None, :]).sum(1, dtype=jnp.int32)
    moved_rank = g - 1 - less.sum(0, dtype=jnp.int32)
    out = jnp.zeros((g,), jnp.int32).at[jnp.where(moved, g, kept_rank)].set(keys[-1], mode="drop")
    return out.at[jnp.where(real, moved_rank, g)].set(mine[-1], mode="drop")


def _repair_or_sort(state: SchedulerState, order, ascending, counts, sort) -> jax.Array:
    """The queue order from a stale `order`: repaired when few slots moved and the result
    checks out (strictly ascending), else `sort()`."""
    keys = _sort_keys(state, order)
    moved = _out_of_place(keys[0], ascending, counts)

    def repair():
        repaired = _repaired(keys, moved)
        return lax.cond(_ascending(state, repaired).all(), lambda: repaired, sort)
    return lax.cond(moved.sum(dtype=jnp.int32) <= REPAIR_UP_TO, repair, sort)


def queues(state: SchedulerState, counts: jax.Array, cached=None) -> Queues:
    """Sort slots by (queue, arrival for running/swapped, queue_key, slot), unless the
    order cached in the state still is sorted (the common case: a steady step keeps it).
    `counts` is int32[3], the sizes of waiting, running and swapped; `cached` is an order
    known to be sorted.

    A step that admits, finishes or preempts a few groups, or takes a few arrivals, leaves
    the other slots in order: from REPAIR_FROM_SLOTS slots up the moved ones are re-ranked
    (`_repair_or_sort`). Not in a batch of runs (a sweep's vmap), where the sort runs when
    any run's repair fails its check: about 5% of one run's stale steps fail it, so a step
    of 64 runs would nearly always (1 - 0.95**64) pay for the repair and the sort.
    """
    g = state.status.shape[-1]
    idx = jnp.arange(g, dtype=jnp.int32)
    if cached is None:
        cached, ascending = _cached_order(state)
        sort = lambda: _sorted_slots(_sort_keys(state, idx))          # noqa: E731
        if g >= REPAIR_FROM_SLOTS and batching.current_axis() is None:
            stale = lambda: _repair_or_sort(state, cached, ascending, counts, sort)   # noqa: E731
        else:
            stale = sort
        # Sorting a sorted order gives it back (the slot index breaks ties).
        cached = batching.cond(~ascending.all(), stale, lambda: cached, same=True)
    pos = jnp.zeros((g,), jnp.int32).at[cached].set(idx)
    count = counts
    return Queues(cached, pos, (jnp.int32(0), count[0], count[0] + count[1]), tuple(count))


def requeue(q: Queues, queue_key, tail_key, categories, queue_of=(0, 1, 1, 2, 2)):
    """Tail keys, in order, for the groups that join the tail of `running` this step.

    `categories` lists disjoint slot masks; category c lies inside queue `queue_of[c]`, so
    its rank in the shared slot order is its rank in that queue's walk order. When every
    category is empty or a whole queue (a steady decode step: all of `running`), the rank is
    the position in the queue and no prefix sum is needed.
    """
    masks = jnp.stack(categories).astype(jnp.int32)              # [C, G] slot space
    sizes = masks.sum(1)
    offsets = [tail_key]
    for size in sizes[:-1]:
        offsets.append(offsets[-1] + size)
    offset = jnp.stack(offsets)
    whole = (sizes == 0) | (sizes == jnp.stack([q.count[i] for i in queue_of]))

    def by_position():
        start = jnp.stack([q.start[i] for i in queue_of])
        return ((offset - start)[:, None] + q.pos[None, :]) * masks

    def by_prefix_sum():
        in_order = jnp.take(masks, q.order, axis=1)
        rank = exclusive_cumsum(in_order, axis=1, bound=in_order.shape[1])
        return jnp.take((offset[:, None] + rank) * in_order, q.pos, axis=1)

    keys = batching.cond(~whole.all(), by_prefix_sum, by_position, same=True).sum(0)
    return jnp.where(masks.any(0), keys, queue_key), tail_key + sizes.sum()
