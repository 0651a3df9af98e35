"""`schedule(state, config, now)`: one step of vLLM's V0 scheduler as a pure function.

Default mode (SPEC A4): admission walk (only with `swapped` empty), then, if nothing was
admitted, the running walk, then, if nothing was preempted, the swapped walk. Chunked mode
(A6): running walk, swapped walk (if nothing was preempted), admission walk. Each walk is a
prefix computation over its queue in priority order (walks.py); the state changes they imply
(preemption, swap-in, allocation, copy-on-write) are applied afterwards as masked updates.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxsched import placement
from jaxsched.block_pool import entry_valid, exclusive_cumsum, first_holder, num_free
from jaxsched.config import Capacity, SchedulerConfig
from jaxsched.preemption import apply_preemption, choose_modes, reverse_exclusive_cumsum
from jaxsched.state import (FINISHED, IGNORE_NEVER_FITS, IGNORE_PROMPT_TOO_LONG, IGNORED,
                            RUNNING, SWAPPED, WAITING, SchedulerState)
from jaxsched.walks import PrefixWalk, RunningInputs, prefix_walk, running_walk, running_walk_loop


class SchedulerOutput(NamedTuple):
    """What one step decided, per slot, plus the block moves for the cache kernels.

    Pair lists are int32[max_pairs, 2] padded with out-of-range ids (the pool sizes), so the
    kernels can scatter with mode="drop"; `num_*` says how many pairs are real.
    """
    scheduled: jax.Array           # bool[G]
    num_scheduled_tokens: jax.Array  # int32[G] prefill chunk, or 1 for a decode
    is_prefill: jax.Array          # bool[G] the chunk is part of the prompt
    num_seqs: jax.Array            # int32[G] sequences running in this step
    preempted: jax.Array           # int32[G] 0 no, 1 recompute, 2 swap
    preempt_order: jax.Array       # int32[G] order of preemption within the step
    swapped_in: jax.Array          # bool[G]
    ignored: jax.Array             # bool[G]
    blocks_to_swap_out: jax.Array  # int32[P, 2] (device, host)
    num_swap_out: jax.Array
    blocks_to_swap_in: jax.Array   # int32[P, 2] (host, device)
    num_swap_in: jax.Array
    blocks_to_copy: jax.Array      # int32[P, 2] (src, dst) device blocks
    num_copy: jax.Array
    num_free_device_blocks: jax.Array
    num_free_host_blocks: jax.Array


def queue_order(member: jax.Array, arrival: jax.Array, key: jax.Array, by_arrival: bool):
    """Slots of a queue in walk order (members first) and the member count."""
    idx = jnp.arange(member.shape[0], dtype=jnp.int32)
    outsider = (~member).astype(jnp.int32)
    if by_arrival:
        order = lax.sort((outsider, arrival, key, idx), num_keys=3)[-1]
    else:
        order = lax.sort((outsider, key, idx), num_keys=2)[-1]
    return order, member.sum(dtype=jnp.int32)


def to_slots(order: jax.Array, values: jax.Array) -> jax.Array:
    return jnp.zeros_like(values).at[order].set(values)


def _ceil_div(a, b):
    return (a + b - 1) // b


def append_plan(table, num_blocks, alive, num_tokens, decode, block_size):
    """Per sequence: needs a new block for its next token, or a copy of a shared last block.

    With several sequences sharing a last block, all but the last holder copy (vLLM order).
    """
    s = alive.shape[1]
    decode = decode[:, None] & alive
    need_new = decode & (_ceil_div(num_tokens, block_size)[:, None] > num_blocks)
    last = jnp.take_along_axis(table, jnp.maximum(num_blocks - 1, 0)[..., None], axis=2)[..., 0]
    same = (last[:, :, None] == last[:, None, :]) & alive[:, :, None] & alive[:, None, :]
    later = jnp.arange(s)[None, :] > jnp.arange(s)[:, None]
    cow = decode & ~need_new & (same & later[None]).any(2)
    return need_new, cow


def _delay_gate(state: SchedulerState, now, runs, is_wait, is_run):
    """SPEC A7: update the latency state when the admission walk runs; is it open?"""
    lim = state.limits
    latency = jnp.where(runs & state.prev_admitted, now - state.prev_time, state.last_prompt_latency)
    earliest = jnp.min(jnp.where(is_wait, state.arrival_time, jnp.inf))
    open_ = ((lim.delay_factor == 0) | ~is_wait.any() | ~is_run.any()
             | ((now - earliest) > lim.delay_factor * latency))
    return open_, latency, jnp.where(runs, now, state.prev_time)


def _admission(state, cap, d, free, token_left, seq_left, enabled):
    """SPEC A4.2 / A6 admission walk over `waiting` (with B1's multi-sequence recomputes)."""
    lim = state.limits
    order, m = queue_order(d["is_wait"], state.arrival_time, state.queue_key, by_arrival=False)
    t = lambda x: jnp.take(x, order, axis=0)
    multi = t(d["n_live"]) > 1
    total = t(state.prefill_total)
    footprint = t(d["footprint"])
    test_need = footprint + jnp.where(multi, t(d["n_live"]), 0)
    never = jnp.where(multi, test_need > lim.num_device_blocks,
                      lim.num_device_blocks - footprint < lim.watermark_blocks)
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
    walk = prefix_walk(never | too_long, test_need, footprint, total,
                       multi | cap.enable_chunked_prefill, t(d["nmax"]), jnp.where(enabled, m, 0),
                       free, lim.watermark_blocks, token_left, seq_left)
    walk = PrefixWalk(*(to_slots(order, x) for x in walk))
    reason = jnp.where(to_slots(order, too_long), IGNORE_PROMPT_TOO_LONG, IGNORE_NEVER_FITS)
    return walk, reason, order


def _swapped(state, cap, d, free, token_left, seq_left, enabled):
    """SPEC A4.5 swapped walk (B2 frees ignored groups' host blocks; B5b chunks a long prefill)."""
    lim = state.limits
    order, m = queue_order(d["is_swap"], state.arrival_time, state.queue_key, by_arrival=True)
    t = lambda x: jnp.take(x, order, axis=0)
    test_need = t(d["held"] + d["n_live"])
    tokens = t(jnp.where(d["in_prefill"], d["rest"], d["n_live"]))
    chunkable = t(d["in_prefill"] & (d["rest"] > lim.max_num_batched_tokens))
    walk = prefix_walk(test_need > lim.num_device_blocks, test_need, t(d["held"] + d["append_h"]),
                       tokens, chunkable, t(d["nmax"]), jnp.where(enabled, m, 0), free,
                       lim.watermark_blocks, token_left, seq_left)
    return PrefixWalk(*(to_slots(order, x) for x in walk)), order


def _running(state, cap, d, free, enabled):
    """SPEC A4.4 / A6 running walk; returns slot-space results and walk-order helpers."""
    lim = state.limits
    order, m = queue_order(d["is_run"], state.arrival_time, state.queue_key, by_arrival=True)
    m = jnp.where(enabled, m, 0)
    t = lambda x: jnp.take(x, order, axis=0)
    inp = RunningInputs(num_seqs=t(d["n_live"]), need=t(d["append_d"]), held=t(d["held"]),
                        full=t(jnp.where(d["in_prefill"], d["rest"], d["n_live"])),
                        is_prefill=t(d["in_prefill"]))
    count = state.artificial_count
    if cap.artificial_preemption:
        key = jax.random.fold_in(state.rng, state.step)
        walk, count = running_walk_loop(inp, m, free, lim.max_num_batched_tokens, key, count)
    else:
        walk = running_walk(inp, m, free, lim.max_num_batched_tokens)
    swap_w, rec_w = choose_modes(walk.preempted, t(d["nmax"]), inp.held, lim.preemption_mode,
                                 num_free(state.host_ref, lim.num_host_blocks))
    # Preemption order is decreasing walk position: ranks among each mode's victims.
    ranks = (to_slots(order, reverse_exclusive_cumsum(rec_w)),
             to_slots(order, reverse_exclusive_cumsum(swap_w)))
    return walk._replace(**{f: to_slots(order, getattr(walk, f)) for f in walk._fields}), \
        to_slots(order, swap_w), to_slots(order, rec_w), ranks, count, order


def _derived(state: SchedulerState, cap: Capacity):
    """Per-group quantities every walk reads, computed once from the state at step start."""
    bs, m = cap.block_size, cap.max_blocks_per_seq
    alive = state.seq_alive
    n_live = alive.sum(1, dtype=jnp.int32)
    is_run, is_wait, is_swap = (state.status == RUNNING), (state.status == WAITING), (state.status == SWAPPED)
    in_prefill = state.prefill_done < state.prefill_total
    leader = jnp.argmax(alive, axis=1)
    group_tokens = jnp.take_along_axis(state.num_tokens, leader[:, None], axis=1)[:, 0]
    table = jnp.where(is_swap[:, None, None], state.host_table, state.block_table)
    valid = entry_valid(state.num_blocks, alive & (is_run | is_swap)[:, None], m)
    holder, is_first = first_holder(table, valid)
    held = (is_first & valid).sum(axis=(1, 2), dtype=jnp.int32)
    need_new, cow = append_plan(table, state.num_blocks, alive, group_tokens, ~in_prefill, bs)
    appends = (need_new | cow).sum(1, dtype=jnp.int32)
    prompt_blocks = state.prompt_len // bs
    seq_blocks = jnp.where(alive, _ceil_div(state.num_tokens, bs), 0).sum(1)
    return dict(
        n_live=n_live, nmax=jnp.where(state.forked, n_live, state.n), is_run=is_run,
        is_wait=is_wait, is_swap=is_swap, in_prefill=in_prefill,
        rest=state.prefill_total - state.prefill_done, held=held, valid=valid, holder=holder,
        is_first=is_first, need_new=need_new, cow=cow,
        append_d=jnp.where(is_run, appends, 0), append_h=jnp.where(is_swap, appends, 0),
        footprint=seq_blocks - jnp.maximum(n_live - 1, 0) * prompt_blocks, leader=leader,
        prompt_blocks=prompt_blocks,
    )


def schedule_impl(state: SchedulerState, now: jax.Array, cap: Capacity):
    """One step, unjitted (for wrapping); `schedule_step` is this under `jax.jit`."""
    lim = state.limits
    now = jnp.asarray(now, jnp.float32)
    d = _derived(state, cap)
    free0 = num_free(state.device_ref, lim.num_device_blocks)
    budget, max_seqs = lim.max_num_batched_tokens, lim.max_num_seqs
    nmax, held = d["nmax"], d["held"]
    admission_runs = jnp.asarray(True) if cap.enable_chunked_prefill else ~d["is_swap"].any()
    gate, latency, prev_time = _delay_gate(state, now, admission_runs, d["is_wait"], d["is_run"])
    sum_if = lambda mask, x: jnp.where(mask, x, 0).sum(dtype=jnp.int32)

    if cap.enable_chunked_prefill:
        run, swap_v, rec_v, ranks, art_count, run_order = _running(state, cap, d, free0, True)
        free1 = free0 + sum_if(run.preempted, held) - sum_if(run.served, d["append_d"])
        tok1 = sum_if(run.served, run.charged)
        seq1 = sum_if(run.served, nmax)
        swp, swp_order = _swapped(state, cap, d, free1, budget - tok1, max_seqs - seq1, ~run.preempted.any())
        free2 = free1 - sum_if(swp.served, held + d["append_h"])
        tok2 = tok1 + sum_if(swp.served, swp.chunk)
        seq2 = seq1 + sum_if(swp.served, nmax)
        adm, ign_reason, adm_order = _admission(state, cap, d, free2, budget - tok2, max_seqs - seq2, gate)
    else:
        seq0 = sum_if(d["is_run"], nmax)
        adm, ign_reason, adm_order = _admission(state, cap, d, free0, budget, max_seqs - seq0,
                                                admission_runs & gate)
        run_enabled = ~adm.served.any()
        run, swap_v, rec_v, ranks, art_count, run_order = _running(state, cap, d, free0, run_enabled)
        free1 = free0 + sum_if(run.preempted, held) - sum_if(run.served, d["append_d"])
        tok1 = sum_if(run.served, run.charged)
        swp, swp_order = _swapped(state, cap, d, free1, budget - tok1, max_seqs - seq0,
                       run_enabled & ~run.preempted.any())

    pre = apply_preemption(state, rec_v, swap_v, ranks[0], ranks[1], d["valid"], d["holder"],
                           d["is_first"], cap.block_size, cap.max_pairs)
    state = pre.state
    state, moves = placement.place(state, cap, d, adm.served, swp.served, run.served, swp.skipped)

    # Ignored groups finish now; swapped ones return their host blocks (SPEC B2).
    ignored = adm.skipped | swp.skipped
    state = state.replace(
        status=jnp.where(ignored, FINISHED, state.status),
        finish_reason=jnp.where(ignored, IGNORED, state.finish_reason),
        ignore_reason=jnp.where(adm.skipped, ign_reason,
                                jnp.where(swp.skipped, IGNORE_NEVER_FITS, state.ignore_reason)),
        seq_alive=state.seq_alive & ~ignored[:, None],
        num_blocks=jnp.where(ignored[:, None], 0, state.num_blocks),
        seq_finish_reason=jnp.where(ignored[:, None] & state.seq_alive, IGNORED, state.seq_finish_reason),
    )

    scheduled = adm.served | swp.served | run.served
    swp_chunk = jnp.where(d["in_prefill"], swp.chunk, 1)      # a decode reports 1 token
    chunk = jnp.where(adm.served, adm.chunk, jnp.where(swp.served, swp_chunk, run.chunk))
    is_prefill = adm.served | ((swp.served | run.served) & d["in_prefill"])
    # New running order: not reached (head), admitted, running decodes, running prefills,
    # swapped-in decodes, swapped-in prefills; each category in its walk order.
    prefill = d["in_prefill"]
    state = _requeue(state, [(adm.served, adm_order), (run.served & ~prefill, run_order),
                             (run.served & prefill, run_order), (swp.served & ~prefill, swp_order),
                             (swp.served & prefill, swp_order)])
    admitted_any = adm.served.any()
    state = state.replace(
        step=state.step + 1, prev_time=prev_time,
        last_prompt_latency=latency,
        prev_admitted=jnp.where(admission_runs, admitted_any, state.prev_admitted),
        artificial_count=art_count,
    )
    out = SchedulerOutput(
        scheduled=scheduled, num_scheduled_tokens=jnp.where(scheduled, chunk, 0),
        is_prefill=is_prefill & scheduled, num_seqs=jnp.where(scheduled, state.num_live_seqs, 0),
        preempted=jnp.where(rec_v, 1, jnp.where(swap_v, 2, 0)).astype(jnp.int32),
        preempt_order=jnp.where(rec_v | swap_v, run.preempt_order, 0),
        swapped_in=swp.served, ignored=ignored,
        blocks_to_swap_out=pre.swap_out_pairs, num_swap_out=pre.num_swap_out,
        blocks_to_swap_in=moves.swap_in_pairs, num_swap_in=moves.num_swap_in,
        blocks_to_copy=moves.copy_pairs, num_copy=moves.num_copy,
        num_free_device_blocks=num_free(state.device_ref, lim.num_device_blocks),
        num_free_host_blocks=num_free(state.host_ref, lim.num_host_blocks),
    )
    return state, out


def _requeue(state, categories):
    """Tail keys, in order, for the groups that join the tail of `running` this step.

    `categories` lists (slot mask, walk order of the walk that served them).
    """
    new_key, offset = state.queue_key, state.tail_key
    for mask, order in categories:
        rank = to_slots(order, exclusive_cumsum(jnp.take(mask, order)))
        new_key = jnp.where(mask, offset + rank, new_key)
        offset = offset + mask.sum(dtype=jnp.int32)
    return state.replace(queue_key=new_key, tail_key=offset)


schedule_step = jax.jit(schedule_impl, static_argnames=("cap",))


def schedule(state: SchedulerState, config: SchedulerConfig | Capacity, now) -> tuple[SchedulerState, SchedulerOutput]:
    """One scheduler step at time `now` (seconds). Pure; compiled once per capacity."""
    cap = config.capacity() if isinstance(config, SchedulerConfig) else config
    return schedule_step(state, now, cap=cap)
