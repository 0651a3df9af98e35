"""Preemption by RECOMPUTE and by SWAP, as transitions over a mask of victims.

The running walk picks victims; this module decides each victim's mode (SPEC A5, B1) and
applies it: recompute frees the device blocks and sends the group to the front of
`waiting`; swap moves its unique blocks to host blocks and sends it to the tail of
`swapped`. Every array is in slot space unless named `_w` (walk order).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxsched.block_pool import (add_refs, compact_pairs, exclusive_cumsum, free_list,
                                 num_free, take_ranked)
from jaxsched.config import PREEMPT_AUTO, PREEMPT_RECOMPUTE, PREEMPT_SWAP
from jaxsched.state import SWAPPED, WAITING, SchedulerState


def reverse_exclusive_cumsum(x: jax.Array) -> jax.Array:
    """out[p] = sum of x[q] for q > p."""
    x = x.astype(jnp.int32)
    return jnp.cumsum(x[::-1])[::-1] - x


def choose_modes(victims_w: jax.Array, nmax_w: jax.Array, held_w: jax.Array, mode: jax.Array,
                 host_free: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Split walk-ordered victims into (swap, recompute) masks.

    Victims are preempted tail first (decreasing walk position). A victim that should swap
    but whose unique blocks no longer fit in the host pool is recomputed instead (SPEC B1);
    later victims still swap when they fit, so the short-host case is a sequential scan.
    """
    auto = jnp.where(nmax_w > 1, PREEMPT_SWAP, PREEMPT_RECOMPUTE)
    wants_swap = victims_w & (jnp.where(mode == PREEMPT_AUTO, auto, mode) == PREEMPT_SWAP)
    need = jnp.where(wants_swap, held_w, 0)

    def greedy(_):
        def body(left, x):
            want, blocks = x
            fits = want & (blocks <= left)
            return left - jnp.where(fits, blocks, 0), fits
        _, fits = lax.scan(body, host_free, (wants_swap, need), reverse=True)
        return fits

    swap = lax.cond(need.sum() <= host_free, lambda _: wants_swap, greedy, None)
    return swap, victims_w & ~swap


class Preempted(NamedTuple):
    state: SchedulerState
    swap_out_pairs: jax.Array    # int32[P, 2] (device block, host block), padded
    num_swap_out: jax.Array


def apply_preemption(state: SchedulerState, recompute: jax.Array, swap: jax.Array,
                     rank_recompute: jax.Array, rank_swap: jax.Array, dev_valid: jax.Array,
                     holder: jax.Array, is_first: jax.Array, block_size: int,
                     max_pairs: int) -> Preempted:
    """Free victims' device blocks; give swap victims host blocks (shared blocks once)."""
    victims = recompute | swap
    entries = dev_valid & victims[:, None, None]
    device_ref = add_refs(state.device_ref, state.block_table, entries, -1)

    # Host blocks for the unique device blocks of swap victims, lowest free first.
    fresh = entries & swap[:, None, None] & is_first
    host_ids = take_ranked(free_list(state.host_ref, state.limits.num_host_blocks),
                           exclusive_cumsum(fresh.reshape(-1)).reshape(fresh.shape), fresh)
    host_new = jnp.take_along_axis(host_ids, holder, axis=1)
    swap_entries = entries & swap[:, None, None]
    host_table = jnp.where(swap[:, None, None], jnp.where(swap_entries, host_new, 0), state.host_table)
    host_ref = add_refs(state.host_ref, host_table, swap_entries, 1)
    pairs, count = compact_pairs(state.block_table, host_new, fresh, max_pairs,
                                 (state.device_ref.shape[0], state.host_ref.shape[0]))

    # Recompute: back to waiting with every token still to compute. A forked group keeps
    # all its sequences; the prompt's full blocks are prefilled once (SPEC B1).
    full_prompt = (state.prompt_len // block_size) * block_size
    lens = jnp.where(state.seq_alive, state.num_tokens, 0).sum(1)
    total = lens - (state.num_live_seqs - 1) * full_prompt
    n_rec = recompute.sum(dtype=jnp.int32)
    n_swap = swap.sum(dtype=jnp.int32)
    new = state.replace(
        status=jnp.where(recompute, WAITING, jnp.where(swap, SWAPPED, state.status)),
        queue_key=jnp.where(recompute, state.front_key - rank_recompute,
                            jnp.where(swap, state.tail_key + rank_swap, state.queue_key)),
        prefill_done=jnp.where(recompute, 0, state.prefill_done),
        prefill_total=jnp.where(recompute, total, state.prefill_total),
        num_preemptions=state.num_preemptions + victims.astype(jnp.int32),
        num_blocks=jnp.where(recompute[:, None], 0, state.num_blocks),
        block_table=jnp.where(victims[:, None, None], 0, state.block_table),
        host_table=host_table, device_ref=device_ref, host_ref=host_ref,
        front_key=state.front_key - n_rec, tail_key=state.tail_key + n_swap,
    )
    return Preempted(new, pairs, count)
