"""`schedule(state, config, now)`: one step of vLLM's V0 scheduler as a pure function.

Default mode (SPEC A4): admission walk (only with `swapped` empty), then, if nothing was
admitted, the running walk, then, if nothing was preempted, the swapped walk. Chunked mode
(A6): running walk, swapped walk (if nothing was preempted), admission walk. Each walk is a
prefix computation over its queue in priority order (walks.py); the state changes they imply
(preemption, swap-in, allocation, copy-on-write) are applied afterwards as masked updates.

Speed (DESIGN-walks.md, STYLE.md; benchmarks/schedule_overhead.py): a step that only
decodes `running` takes `_steady`, a handful of kernels; any other takes `_general`, the
walks in full. The three queues share one slot order, cached in the state and re-sorted
only when a check finds it stale; walks and block work that a step does not need (an empty
queue, no victim, no block to hand out) are skipped by `lax.cond`; the state and the
output cross the jit boundary as one to three flat arrays.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxsched.core import batching, placement
from jaxsched.core.block_pool import entry_valid, exclusive_cumsum, first_holder, num_free
from jaxsched.core.config import PREEMPT_RECOMPUTE, PREEMPT_SWAP, Capacity, SchedulerConfig
from jaxsched.core.placement import Blocks, no_pairs
from jaxsched.core.preemption import (choose_modes, free_victims, no_victims, pick_modes,
                                 preempted_fields, recompute_tokens)
from jaxsched.core.state import (FINISHED, IGNORE_NEVER_FITS, IGNORE_PROMPT_TOO_LONG, IGNORED,
                            RUNNING, SWAPPED, WAITING, SchedulerOutput, SchedulerState)
from jaxsched.core.walks import (BIG, PrefixWalk, Queues, RunningInputs, order_is_cached, prefix_walk,
                            queues, requeue, running_walk, running_walk_loop)


def _ceil_div(a, b):
    return (a + b - 1) // b


def append_plan(table, num_blocks, alive, num_tokens, decode, block_size):
    """Per sequence: needs a new block for its next token, or a copy of a shared last block.

    With several sequences sharing a last block, all but the last holder copy (vLLM order).
    """
    s = alive.shape[1]
    decode = decode[:, None] & alive
    need_new = decode & (_ceil_div(num_tokens, block_size)[:, None] > num_blocks)
    if s == 1:
        return need_new, jnp.zeros_like(need_new)
    last = jnp.take_along_axis(table, jnp.maximum(num_blocks - 1, 0)[..., None], axis=2)[..., 0]
    same = (last[:, :, None] == last[:, None, :]) & alive[:, :, None] & alive[:, None, :]
    later = jnp.arange(s)[None, :] > jnp.arange(s)[:, None]
    cow = decode & ~need_new & (same & later[None]).any(2)
    return need_new, cow


def _delay_gate(state: SchedulerState, now, runs, any_wait, any_run, is_wait):
    """SPEC A7: update the latency state when the admission walk runs; is it open?"""
    lim = state.limits
    latency = jnp.where(runs & state.prev_admitted, now - state.prev_time, state.last_prompt_latency)
    earliest = jnp.min(jnp.where(is_wait, state.arrival_time, jnp.inf))
    open_ = ((lim.delay_factor == 0) | ~any_wait | ~any_run
             | ((now - earliest) > lim.delay_factor * latency))
    return open_, latency, jnp.where(runs, now, state.prev_time)


def _no_walk(g: int) -> PrefixWalk:
    return PrefixWalk(jnp.zeros((g,), bool), jnp.zeros((g,), bool), jnp.zeros((g,), jnp.int32),
                      jnp.int32(BIG), jnp.int32(BIG))


def _with_never(walk: PrefixWalk, never_tested: jax.Array) -> PrefixWalk:
    """The walk's block slack, negative where it ignored a group as NEVER (that group's
    block test failed: with more blocks it would have been served or waited)."""
    return walk._replace(block_slack=jnp.where(never_tested.any(), -1, walk.block_slack))


def _admission(state, cap, d, q: Queues, free, token_left, seq_left, walk=None):
    """SPEC A4.2 / A6 admission walk over `waiting` (with B1's multi-sequence recomputes).

    `walk(order, *prefix_walk's arguments) -> (PrefixWalk, extra)` replaces `prefix_walk`
    (prefix caching's sequential walk, core/cached_step.py); `extra` is returned last."""
    lim = state.limits
    order, m = q.walk(0), q.count[0]
    t = lambda x: jnp.take(x, order, axis=0)
    n_live = t(d.n_live)
    multi = n_live > 1
    total = t(state.prefill_total)
    seq_blocks = jnp.where(state.seq_alive, _ceil_div(state.num_tokens, cap.block_size), 0).sum(1)
    footprint = t(seq_blocks) - jnp.maximum(n_live - 1, 0) * t(d.prompt_blocks)
    test_need = footprint + jnp.where(multi, n_live, 0)
    # NEVER wherever the watermark can never be met, also for B1's forked re-admissions:
    # with `need > num_device_blocks - watermark_blocks` the group would wait forever.
    never = lim.num_device_blocks - test_need < lim.watermark_blocks
    single = ~multi
    if cap.enable_chunked_prefill:
        # The chunk min(prompt, budget left) is compared with max_model_len, so a long
        # prompt is ignored only while more than max_model_len tokens are left.
        big = single & (total > lim.max_model_len)
        small_before = exclusive_cumsum(jnp.where(~never & ~big, total, 0))
        over = big & (token_left - small_before > lim.max_model_len)
        first_fit = jnp.argmax(big & ~never & ~over) + jnp.where((big & ~never & ~over).any(), 0, order.shape[0])
        too_long = over & ~never & (jnp.arange(order.shape[0]) < first_fit)
    else:
        too_long = single & (total > jnp.minimum(lim.max_model_len, lim.max_num_batched_tokens))
    args = (never | too_long, test_need, footprint, total, multi | cap.enable_chunked_prefill,
            t(d.nmax), m, free, lim.watermark_blocks, token_left, seq_left)
    result, extra = (prefix_walk(*args), None) if walk is None else walk(order, *args)
    # A prompt too long is ignored before its block test (vLLM's order).
    result = _with_never(result, result.skipped & never & ~too_long)
    served, skipped, chunk, too_long = q.to_slots(0, d.is_wait, *result[:3], too_long)
    reason = jnp.where(too_long, IGNORE_PROMPT_TOO_LONG, IGNORE_NEVER_FITS)
    out = PrefixWalk(served, skipped, chunk, result.block_slack, result.seq_slack), reason
    return out if walk is None else out + (extra,)


def _swapped(state, cap, d, q: Queues, free, token_left, seq_left, walk=None):
    """SPEC A4.5 swapped walk (B2 frees ignored groups' host blocks; B5b chunks a long prefill).
    `walk` as in `_admission`."""
    lim = state.limits
    order, m = q.walk(2), q.count[2]
    t = lambda x: jnp.take(x, order, axis=0)
    test_need = t(d.held + d.n_live)
    tokens = t(jnp.where(d.in_prefill, d.rest, d.n_live))
    chunkable = t(d.in_prefill & (d.rest > lim.max_num_batched_tokens))
    append_h = jnp.where(d.is_swap, d.appends, 0)
    args = (lim.num_device_blocks - test_need < lim.watermark_blocks, test_need, t(d.held + append_h),
            tokens, chunkable, t(d.nmax), m, free, lim.watermark_blocks, token_left, seq_left)
    result, extra = (prefix_walk(*args), None) if walk is None else walk(order, *args)
    result = _with_never(result, result.skipped)        # every skip here is a NEVER
    out = PrefixWalk(*q.to_slots(2, d.is_swap, *result[:3]), result.block_slack, result.seq_slack)
    return out if walk is None else (out, extra)


class Running(NamedTuple):
    served: jax.Array          # bool[G], slot space
    preempted: jax.Array       # bool[G]
    preempt_order: jax.Array   # int32[G]
    chunk: jax.Array           # int32[G]
    charged: jax.Array         # int32[G]
    preempted_w: jax.Array     # bool[G], walk order (for choosing modes)
    count: jax.Array           # artificial failures left
    block_slack: jax.Array     # int32[] (walks.running_walk)


def _running(state, cap, d, q: Queues, free, enabled):
    """SPEC A4.4 / A6 running walk (skipped when disabled or `running` is empty).

    NOTE: most steps serve every running group. When the whole queue's tokens fit the budget
    and the free blocks cover all appends with max_seqs_per_group to spare, the walk can
    neither stop nor preempt (every group passes `can_append_slots` with the blocks left
    after all appends), so its outcome is known without the prefix sums: the `everyone`
    branch. Artificial preemption always walks.
    """
    lim = state.limits
    g = d.is_run.shape[0]
    count = state.artificial_count
    full = jnp.where(d.in_prefill, d.rest, d.n_live)

    def walk():
        order, m = q.walk(1), q.count[1]
        t = lambda x: jnp.take(x, order, axis=0)
        append_d = jnp.where(d.is_run, d.appends, 0)
        inp = RunningInputs(num_seqs=t(d.n_live), need=t(append_d), held=t(d.held),
                            full=t(full), is_prefill=t(d.in_prefill))
        # SPEC B5 applies only where a lone prefill at the head would be recomputed.
        head = batching.cond(inp.is_prefill[0], lambda: _head_recomputes(state, cap, d, order, m),
                             lambda: jnp.asarray(True))
        if cap.artificial_preemption:
            key = jax.random.fold_in(state.rng, state.step)
            walk, cnt = running_walk_loop(inp, m, free, lim.max_num_batched_tokens, key, count,
                                          head_recomputes=head)
        else:
            bound = cap.num_slots * cap.max_seqs_per_group * (cap.max_blocks_per_seq + 1)
            walk, cnt = running_walk(inp, m, free, lim.max_num_batched_tokens, bound, head), count
        return Running(*q.to_slots(1, d.is_run, *walk[:5]), walk.preempted, cnt, walk.block_slack)

    def everyone():
        zb, zi = jnp.zeros((g,), bool), jnp.zeros((g,), jnp.int32)
        chunk = jnp.where(d.is_run & d.in_prefill, full, jnp.where(d.is_run, 1, 0))
        charged = jnp.where(d.is_run, jnp.where(d.in_prefill, full, d.n_live), 0)
        return Running(d.is_run, zb, zi, chunk, charged, zb, count, _everyone_slack(d, free, cap))

    def skip():
        zb, zi = jnp.zeros((g,), bool), jnp.zeros((g,), jnp.int32)
        return Running(zb, zb, zi, zi, zi, zb, count, jnp.int32(BIG))

    fits = _everyone_fits(d, lim, free, cap)
    branch = jnp.where(enabled & (q.count[1] > 0), jnp.where(fits, 1, 2), 0)
    return batching.switch(branch, [skip, everyone, walk])


def _head_recomputes(state, cap: Capacity, d, order, m) -> jax.Array:
    """Would the head of `running` be recomputed, preempted after every group behind it?

    That is the only way a lone head prefill is preempted (SPEC B5): the tail goes first,
    taking host blocks where it swaps, so the head's mode is `choose_modes` over them all.
    """
    lim = state.limits
    t = lambda x: jnp.take(x, order, axis=0)
    tokens = recompute_tokens(state.prompt_len, state.seq_alive, state.num_tokens, cap.block_size)
    everyone = jnp.arange(order.shape[0]) < m
    swap_w, _ = choose_modes(everyone, t(d.nmax), t(d.held), t(tokens), lim.preemption_mode,
                             lim.costs, num_free(state.host_ref, lim.num_host_blocks))
    return ~swap_w[0]


def _everyone_fits(d, lim, free, cap: Capacity) -> jax.Array:
    """The running walk serves every running group: all their tokens fit the budget, and
    `free` covers all appends with max_seqs_per_group to spare (see `_running`)."""
    if cap.artificial_preemption:
        return jnp.asarray(False)
    budget = lim.max_num_batched_tokens
    g = d.is_run.shape[0]
    # run_tokens sums min(full, budget + 1): exact while it is <= budget, and it cannot wrap
    # when budget < 2**31 / G.
    return ((d.run_tokens <= budget) & (budget < (2**31 - 1) // g - 1)
            & (free - d.run_appends >= cap.max_seqs_per_group))


def _everyone_slack(d, free, cap: Capacity) -> jax.Array:
    """A lower bound on the running walk's `block_slack` when every group passes: each
    check sees at most all appends taken and asks for at most max_seqs_per_group blocks."""
    return (free - d.run_appends - cap.max_seqs_per_group).astype(jnp.int32)


def _sharing(state: SchedulerState, d, cap: Capacity):
    """(valid, holder, is_first) of the step-start tables (block_pool.first_holder).

    Device blocks for running groups, host blocks for swapped ones. With one sequence per
    group nothing is shared, and the [G, S, S, M] comparison is skipped.
    """
    valid = entry_valid(state.num_blocks, state.seq_alive & (d.is_run | d.is_swap)[:, None],
                        cap.max_blocks_per_seq)
    if cap.max_seqs_per_group == 1:
        return valid, jnp.zeros(valid.shape, jnp.int32), jnp.ones(valid.shape, bool)
    return (valid,) + first_holder(state.block_table, valid)


class StepValues(NamedTuple):
    """What a step derives from the state before its walks (G groups, S sequences each).

    `_basics` fills the first part, which every step reads; `_derived` adds the rest, which
    only the general step needs (None until then).
    """
    n_live: jax.Array          # int32[G] live sequences
    is_run: jax.Array          # bool[G] in running
    is_wait: jax.Array         # bool[G] in waiting
    is_swap: jax.Array         # bool[G] in swapped
    in_prefill: jax.Array      # bool[G] prompt (or recompute) not yet fully computed
    rest: jax.Array            # int32[G] prefill tokens left
    leader: jax.Array          # int32[G] the first live sequence
    need_new: jax.Array        # bool[G, S] a decode needs a fresh block
    cow: jax.Array             # bool[G, S] a decode's last block is shared: copy-on-write
    appends: jax.Array         # int32[G] blocks a decode step appends
    totals: jax.Array          # int32[7] the sums below, from one reduction
    counts: jax.Array          # int32[3] sizes of waiting, running, swapped
    run_tokens: jax.Array      # int32[] tokens all of running asks for (capped per group)
    run_appends: jax.Array     # int32[] blocks all of running appends
    run_prefills: jax.Array    # int32[] running groups in prefill
    decode_appends: jax.Array  # int32[] running decodes that append a block
    share: tuple | None = None           # (valid, holder, is_first) of the step-start tables
    held: jax.Array | None = None        # int32[G] distinct blocks a group holds
    nmax: jax.Array | None = None        # int32[G] vLLM's get_max_num_running_seqs
    prompt_blocks: jax.Array | None = None   # int32[G] full blocks of the prompt


def _basics(state: SchedulerState, cap: Capacity, totals=None) -> StepValues:
    """Per-group quantities every step reads: queues, prefill progress, appends.

    `totals` (int32[7], from an earlier call) skips the reduction that sums them up.
    """
    alive = state.seq_alive
    n_live = alive.sum(1, dtype=jnp.int32)
    status = state.status
    is_run, is_wait, is_swap = (status == RUNNING), (status == WAITING), (status == SWAPPED)
    in_prefill = state.prefill_done < state.prefill_total
    rest = state.prefill_total - state.prefill_done
    leader = jnp.argmax(alive, axis=1)
    group_tokens = jnp.take_along_axis(state.num_tokens, leader[:, None], axis=1)[:, 0]
    # Host blocks for swapped groups: they share as their device blocks did (copy-on-write).
    need_new, cow = append_plan(state.block_table, state.num_blocks, alive, group_tokens,
                                ~in_prefill, cap.block_size)
    appends = (need_new | cow).sum(1, dtype=jnp.int32)
    # One reduction for the queue sizes and the running queue's token and block needs.
    budget = state.limits.max_num_batched_tokens
    full = jnp.minimum(jnp.where(in_prefill, rest, n_live), budget + 1)
    if totals is None:
        totals = jnp.stack([is_wait, is_run, is_swap, is_run * full, is_run * appends,
                            is_run & in_prefill, is_run & ~in_prefill & (appends > 0)]
                           ).astype(jnp.int32).sum(1)
    return StepValues(n_live=n_live, is_run=is_run, is_wait=is_wait, is_swap=is_swap,
                      in_prefill=in_prefill, rest=rest, leader=leader, need_new=need_new, cow=cow,
                      appends=appends, totals=totals, counts=totals[:3], run_tokens=totals[3],
                      run_appends=totals[4], run_prefills=totals[5], decode_appends=totals[6])


def _derived(state: SchedulerState, cap: Capacity, basics: StepValues) -> StepValues:
    """`basics` plus what the walks and the block work read (held blocks, n or live seqs)."""
    d = basics
    share = valid, _, is_first = _sharing(state, d, cap)
    if cap.max_seqs_per_group == 1:
        alive, m = state.seq_alive, cap.max_blocks_per_seq
        live = alive & (d.is_run | d.is_swap)[:, None]
        held = jnp.where(live, jnp.clip(state.num_blocks, 0, m), 0)[:, 0]
    else:
        held = (is_first & valid).sum(axis=(1, 2), dtype=jnp.int32)
    return d._replace(share=share, held=held, nmax=jnp.where(state.forked, d.n_live, state.n),
                      prompt_blocks=state.prompt_len // cap.block_size)


def _walks(state, cap, d, q, free0, admission_runs, gate):
    """The three walks in the mode's order; returns (admitted, swapped-in, running)."""
    lim = state.limits
    g = d.is_run.shape[0]
    budget, max_seqs = lim.max_num_batched_tokens, lim.max_num_seqs
    nmax, held = d.nmax, d.held
    sum_if = lambda mask, x: jnp.where(mask, x, 0).sum(dtype=jnp.int32)
    append_d = jnp.where(d.is_run, d.appends, 0)
    append_h = jnp.where(d.is_swap, d.appends, 0)

    def admission(free, token_left, seq_left, enabled):
        return batching.cond(enabled & (q.count[0] > 0),
                             lambda: _admission(state, cap, d, q, free, token_left, seq_left),
                             lambda: (_no_walk(g), jnp.zeros((g,), jnp.int32)))

    def swapped(free, token_left, seq_left, enabled):
        return batching.cond(enabled & (q.count[2] > 0),
                             lambda: _swapped(state, cap, d, q, free, token_left, seq_left),
                             lambda: _no_walk(g))

    if cap.enable_chunked_prefill:
        run = _running(state, cap, d, q, free0, jnp.asarray(True))
        free1 = free0 + sum_if(run.preempted, held) - sum_if(run.served, append_d)
        tok1 = sum_if(run.served, run.charged)
        seq1 = sum_if(run.served, nmax)
        swp = swapped(free1, budget - tok1, max_seqs - seq1, ~run.preempted.any())
        free2 = free1 - sum_if(swp.served, held + append_h)
        tok2 = tok1 + sum_if(swp.served, swp.chunk)
        seq2 = seq1 + sum_if(swp.served, nmax)
        adm, reason = admission(free2, budget - tok2, max_seqs - seq2, gate)
    else:
        seq0 = sum_if(d.is_run, nmax)
        adm, reason = admission(free0, budget, max_seqs - seq0, admission_runs & gate)
        run_enabled = ~adm.served.any()
        run = _running(state, cap, d, q, free0, run_enabled)
        free1 = free0 + sum_if(run.preempted, held) - sum_if(run.served, append_d)
        tok1 = sum_if(run.served, run.charged)
        swp = swapped(free1, budget - tok1, max_seqs - seq0, run_enabled & ~run.preempted.any())
    return adm, reason, swp, run


def schedule_impl(state: SchedulerState, cap: Capacity, now: jax.Array, steady_path: bool = True):
    """One step, unjitted (for wrapping); `schedule_step` is this under `jax.jit`.

    NOTE: most steps of a serving loop only decode: nothing waits, nothing is swapped out,
    and every running group fits. Such a step takes `_steady`, which computes the same
    result as `_general` without the walks' prefix sums and the block work that cannot
    happen. `steady_path=False` forces the general step (tests compare the two). Only
    scalars cross into the branches; each recomputes its per-group values from the state,
    so nothing is materialized for a branch that does not run.
    """
    lim = state.limits
    now = jnp.asarray(now, jnp.float32)
    free0 = num_free(state.device_ref, lim.num_device_blocks)
    if cap.enable_prefix_caching:           # SPEC A10: the walks run group by group
        from jaxsched.core.cached_step import general_cached
        return general_cached(state, now, cap)
    if not steady_path or cap.artificial_preemption:
        new_state, parts = _general(state, now, cap, free0)
        return new_state, SchedulerOutput.pack(*parts)
    b = _basics(state, cap)
    totals = b.totals
    n_wait, n_run, n_swap = b.counts
    order, sorted_ = order_is_cached(state)
    # All of `running` decodes, or all of it prefills: it rejoins in its order (no prefix sum).
    one_kind = (b.run_prefills == 0) | (b.run_prefills == n_run)
    # In a batch of runs an empty run (not started, or drained) takes the steady step too,
    # which does for it what the general step would; alone it takes the general step.
    busy = (n_run > 0) if batching.current_axis() is None else jnp.asarray(True)
    steady = ((n_wait == 0) & (n_swap == 0) & busy & one_kind & sorted_
              & _everyone_fits(b, lim, free0, cap))
    # Ordered by cost; each branch gives what the cheaper ones would, for the steps they
    # take (tests/test_differential.py), so a batch of runs takes the costliest any needs.
    branch = jnp.where(steady, jnp.where(b.decode_appends > 0, 1, 0), 2)
    # The output leaves the switch in parts, packed after it: a caller that never reads the
    # block pairs (a sweep) lets XLA drop them from every branch (a packed output would be
    # written whole by each branch, the pair lists included).
    new_state, parts = batching.switch(branch, [
        lambda: _steady(state, now, cap, free0, totals, order, allocate=False),
        lambda: _steady(state, now, cap, free0, totals, order, allocate=True),
        lambda: _general(state, now, cap, free0, totals)], covers=True)
    return new_state, SchedulerOutput.pack(*parts)


def _steady(state, now, cap: Capacity, free0, totals, order, allocate: bool):
    """A step that serves every running group and nothing else (see `schedule_impl`).

    The admission walk runs (nothing is swapped) and admits nobody; the running walk serves
    everyone (`_running`'s `everyone`); the swapped walk has nobody to serve. `running` is
    all decodes or all prefills, so it rejoins in its own order. Only decode slots may need
    blocks (`allocate`). `order` is the cached queue order, still sorted.
    """
    lim = state.limits
    d = _basics(state, cap, totals)
    q = queues(state, d.counts, order)
    host_free0 = num_free(state.host_ref, lim.num_host_blocks)
    run, prefill = d.is_run, d.in_prefill
    decode = run & ~prefill
    g = run.shape[0]
    blk = Blocks(state.block_table, state.num_blocks, state.device_ref, state.host_ref)
    pairs = no_pairs(cap)
    num_copy, free_dev = jnp.int32(0), free0
    if allocate:
        blk, pairs, num_copy = placement.append_slots(blk, pairs, d, decode, lim.num_device_blocks)
        # Each append takes a free block (a copied-from shared block keeps a reference).
        free_dev = free0 - d.run_appends
    none = jnp.zeros((g,), bool)
    # `running` rejoins its own tail in walk order: all decodes, or all prefills (SPEC B8).
    queue_key = jnp.where(run, state.tail_key + q.pos - q.start[1], state.queue_key)
    tail_key = state.tail_key + q.count[1]
    new_state = state.replace(
        queue_key=queue_key, walk_order=q.order, num_blocks=blk.num_blocks,
        block_table=blk.block_table, device_ref=blk.device_ref, tail_key=tail_key,
        step=state.step + 1, prev_time=now, prev_admitted=False,
        last_prompt_latency=jnp.where(state.prev_admitted, now - state.prev_time,
                                      state.last_prompt_latency))
    chunk = jnp.where(prefill, d.rest, 1)
    zero = jnp.zeros((g,), jnp.int32)
    slots = jnp.stack([run, jnp.where(run, chunk, 0), run & prefill,
                       jnp.where(run, d.n_live, 0), zero, zero, none, none]).astype(jnp.int32)
    counts = jnp.stack([jnp.int32(0), jnp.int32(0), num_copy, free_dev, host_free0,
                        _everyone_slack(d, free0, cap), jnp.int32(BIG)])
    return new_state, (slots, pairs, counts)


def _general(state, now, cap: Capacity, free0, totals=None):
    """Any step, as a path through named stages: derive, walk, preempt, place, commit."""
    lim = state.limits
    d = _derived(state, cap, _basics(state, cap, totals))
    q = queues(state, d.counts)
    any_wait, any_run, any_swap = (c > 0 for c in d.counts)
    admission_runs = jnp.asarray(True) if cap.enable_chunked_prefill else ~any_swap
    gate, latency, prev_time = _delay_gate(state, now, admission_runs, any_wait, any_run, d.is_wait)
    adm, ign_reason, swp, run = _walks(state, cap, d, q, free0, admission_runs, gate)
    host_free0 = num_free(state.host_ref, lim.num_host_blocks)
    v, blk, pairs, num_swap_out, free_dev, free_host = _preempt(state, cap, d, q, run, free0, host_free0)
    fields = {n: getattr(state, n) for n in ("status", "queue_key", "prefill_done", "prefill_total",
                                             "num_preemptions", "front_key", "tail_key",
                                             "prompt_len", "seq_alive", "num_tokens")}
    fields.update(preempted_fields(fields, v, cap.block_size))
    blk, pairs, num_swap_in, num_copy, free_dev, free_host = _place(
        state, cap, d, adm, swp, run, blk, pairs, free_dev, free_host)
    new_state = _commit(state, d, q, adm, ign_reason, swp, run, fields, blk, admission_runs,
                        prev_time, latency)
    parts = _output(d, adm, swp, run, v, pairs,
                    jnp.stack([num_swap_out, num_swap_in, num_copy, free_dev, free_host,
                               jnp.minimum(jnp.minimum(adm.block_slack, swp.block_slack), run.block_slack),
                               jnp.minimum(adm.seq_slack, swp.seq_slack)]))
    return new_state, parts


def _preempt(state, cap: Capacity, d: StepValues, q: Queues, run: Running, free0, host_free0):
    """Preemption (rare): each victim's mode, its device blocks freed, host blocks for swaps.

    Returns (victims, blocks, pairs, num_swap_out, free device, free host)."""
    lim = state.limits
    g = state.status.shape[0]

    def preempt(blk, pairs):
        run_w = q.walk(1)
        tokens = recompute_tokens(state.prompt_len, state.seq_alive, state.num_tokens, cap.block_size)
        v = pick_modes(run.preempted_w, jnp.take(d.nmax, run_w), jnp.take(d.held, run_w),
                       jnp.take(tokens, run_w), lim.preemption_mode, lim.costs, host_free0,
                       lambda *xs: q.to_slots(1, d.is_run, *xs))
        blk, pairs, count = free_victims(blk, pairs, v, d.share, lim.num_host_blocks)
        return (v, blk, pairs, count, num_free(blk.device_ref, lim.num_device_blocks),
                num_free(blk.host_ref, lim.num_host_blocks))

    def no_preempt(blk, pairs):
        return no_victims(g), blk, pairs, jnp.int32(0), free0, host_free0

    blk = Blocks(state.block_table, state.num_blocks, state.device_ref, state.host_ref)
    v, blk, pairs, count, free_dev, free_host = batching.cond(
        run.preempted.any(), preempt, no_preempt, blk, no_pairs(cap), same=True)
    blk = blk._replace(num_blocks=jnp.where(v.recompute[:, None], 0, blk.num_blocks))
    return v, blk, pairs, count, free_dev, free_host


def _place(state, cap: Capacity, d: StepValues, adm, swp, run, blk, pairs, free_dev, free_host):
    """Blocks for the scheduled groups: admitted and swapped-in tables, appends and
    copy-on-write (skipped when nothing needs one). Returns (blocks, pairs, num_swap_in,
    num_copy, free device, free host)."""
    lim = state.limits
    decoding = (run.served | swp.served) & ~d.in_prefill
    appending = (d.need_new | d.cow).any(1) & decoding
    moved = adm.served | swp.served | swp.skipped

    def place(blk, pairs, free_dev, free_host):
        blk, pairs, num_in, num_copy = placement.place(
            blk, pairs, state.seq_alive, state.num_tokens, d, d.share,
            adm.served, swp.served, run.served, swp.skipped, lim.num_device_blocks, cap.block_size)
        return (blk, pairs, num_in, num_copy, num_free(blk.device_ref, lim.num_device_blocks),
                num_free(blk.host_ref, lim.num_host_blocks))

    def no_place(blk, pairs, free_dev, free_host):
        return blk, pairs, jnp.int32(0), jnp.int32(0), free_dev, free_host

    return batching.cond(moved.any() | appending.any(), place, no_place, blk, pairs, free_dev,
                         free_host, same=True)


def _commit(state, d: StepValues, q: Queues, adm, ign_reason, swp, run, fields, blk,
            admission_runs, prev_time, latency) -> SchedulerState:
    """The new state: queues and keys, ignored groups finished (swapped ones returned their
    host blocks in `_place`, SPEC B2), the table and pools, the delay gate's clock."""
    ignored = adm.skipped | swp.skipped
    alive = state.seq_alive
    prefill = d.in_prefill
    queue_key, tail_key = requeue(q, fields["queue_key"], fields["tail_key"],
                                   [adm.served, run.served & ~prefill, run.served & prefill,
                                    swp.served & ~prefill, swp.served & prefill])
    return state.replace(
        status=jnp.where(ignored, FINISHED,
                         jnp.where(adm.served | swp.served, RUNNING, fields["status"])),
        finish_reason=jnp.where(ignored, IGNORED, state.finish_reason),
        ignore_reason=jnp.where(adm.skipped, ign_reason,
                                jnp.where(swp.skipped, IGNORE_NEVER_FITS, state.ignore_reason)),
        queue_key=queue_key, prefill_done=fields["prefill_done"],
        prefill_total=fields["prefill_total"], num_preemptions=fields["num_preemptions"],
        walk_order=q.order,
        seq_alive=alive & ~ignored[:, None],
        seq_finish_reason=jnp.where(ignored[:, None] & alive, IGNORED, state.seq_finish_reason),
        num_blocks=jnp.where(ignored[:, None], 0, blk.num_blocks),
        block_table=blk.block_table,
        device_ref=blk.device_ref, host_ref=blk.host_ref,
        tail_key=tail_key, front_key=fields["front_key"], step=state.step + 1,
        prev_time=prev_time, last_prompt_latency=latency,
        prev_admitted=jnp.where(admission_runs, adm.served.any(), state.prev_admitted),
        artificial_count=run.count,
    )


def _output(d: StepValues, adm, swp, run, v, pairs, counts) -> tuple:
    """What the step decided, per slot, for the engine and the cache kernels: the parts of
    `SchedulerOutput.pack` (slots, pairs, counts)."""
    prefill = d.in_prefill
    scheduled = adm.served | swp.served | run.served
    swp_chunk = jnp.where(prefill, swp.chunk, 1)      # a decode reports 1 token
    chunk = jnp.where(adm.served, adm.chunk, jnp.where(swp.served, swp_chunk, run.chunk))
    is_prefill = adm.served | ((swp.served | run.served) & prefill)
    victims = v.recompute | v.swap
    slots = jnp.stack([scheduled, jnp.where(scheduled, chunk, 0), is_prefill & scheduled,
                       jnp.where(scheduled, d.n_live, 0),
                       jnp.where(v.recompute, PREEMPT_RECOMPUTE, jnp.where(v.swap, PREEMPT_SWAP, 0)),
                       jnp.where(victims, run.preempt_order, 0), swp.served, adm.skipped | swp.skipped]
                      ).astype(jnp.int32)
    return slots, pairs, counts


schedule_step = jax.jit(schedule_impl, static_argnames=("cap", "steady_path"))


def schedule(state: SchedulerState, config: SchedulerConfig | Capacity, now) -> tuple[SchedulerState, SchedulerOutput]:
    """One scheduler step at time `now` (seconds). Pure; compiled once per capacity."""
    cap = config.capacity() if isinstance(config, SchedulerConfig) else config
    return schedule_step(state, cap, now)
