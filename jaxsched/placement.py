"""Give scheduled groups their device blocks: admission, swap-in, decode slots, copy-on-write.

All of a step's requests are served by one ranking over the free list: decode slots take
the lowest free blocks, then the fresh table entries of admitted and swapped-in groups. An
entry that shares a block with a lower sequence of its group (a forked prompt block) takes
that sequence's new block, so sharing survives swap-in and re-admission.

    block table of a re-admitted forked group (prompt of 2 full blocks + a partial one):
      seq 0 (leader): [ a  b | c0 d0 ]      a, b: the prompt's full blocks, ref count n
      seq 1:          [ a  b | c1 d1 ]      c, d: each sequence's own tokens on top
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxsched.block_pool import add_refs, compact_pairs, exclusive_cumsum, free_list, take_ranked
from jaxsched.config import Capacity
from jaxsched.state import RUNNING, SchedulerState


class Moves(NamedTuple):
    swap_in_pairs: jax.Array   # int32[P, 2] (host block, device block), padded
    num_swap_in: jax.Array
    copy_pairs: jax.Array      # int32[P, 2] (src, dst) device blocks, padded
    num_copy: jax.Array


def _admitted_entries(state: SchedulerState, d, admitted, width, block_size):
    """(valid, holder) of the new tables of admitted groups; prompt blocks shared (SPEC B1)."""
    s = state.seq_alive.shape[1]
    seq = jnp.arange(s, dtype=jnp.int32)[None, :, None]
    pos = jnp.arange(width)[None, None, :]
    num_blocks = jnp.where(state.seq_alive, (state.num_tokens + block_size - 1) // block_size, 0)
    is_leader = seq[..., 0] == d["leader"][:, None]
    shared = jnp.where((d["n_live"] > 1)[:, None] & ~is_leader, d["prompt_blocks"][:, None], 0)
    holder = jnp.where(pos < shared[..., None], d["leader"][:, None, None].astype(jnp.int32), seq)
    valid = admitted[:, None, None] & state.seq_alive[..., None] & (pos < num_blocks[..., None])
    return valid, holder, num_blocks


def place(state: SchedulerState, cap: Capacity, d: dict, admitted, swapped_in, run_served,
          swap_ignored) -> tuple[SchedulerState, Moves]:
    g, s, width = state.block_table.shape
    lim = state.limits
    pool_size, host_size = state.device_ref.shape[0], state.host_ref.shape[0]
    adm_valid, adm_holder, adm_blocks = _admitted_entries(state, d, admitted, width, cap.block_size)
    seq = jnp.arange(s, dtype=jnp.int32)[None, :, None]
    swap_valid = d["valid"] & swapped_in[:, None, None]
    fresh = (adm_valid & (adm_holder == seq)) | (swap_valid & d["is_first"])
    new_valid = adm_valid | swap_valid
    holder = jnp.where(admitted[:, None, None], adm_holder, d["holder"])

    decoding = ((run_served | swapped_in) & ~d["in_prefill"])[:, None]
    app_new, app_cow = d["need_new"] & decoding, d["cow"] & decoding
    app = app_new | app_cow

    blocks = free_list(state.device_ref, lim.num_device_blocks)
    app_rank = exclusive_cumsum(app.reshape(-1)).reshape(g, s)
    app_id = take_ranked(blocks, app_rank, app)
    fresh_rank = app.sum(dtype=jnp.int32) + exclusive_cumsum(fresh.reshape(-1)).reshape(fresh.shape)
    fresh_id = take_ranked(blocks, fresh_rank, fresh)

    changed = (admitted | swapped_in)[:, None, None]
    mapped = jnp.where(new_valid, jnp.take_along_axis(fresh_id, holder, axis=1), 0)
    table = jnp.where(changed, mapped, state.block_table)
    num_blocks = jnp.where(admitted[:, None], adm_blocks, state.num_blocks)
    device_ref = add_refs(state.device_ref, mapped, new_valid, 1)

    last = jnp.maximum(num_blocks - 1, 0)
    cow_src = jnp.take_along_axis(table, last[..., None], axis=2)[..., 0]
    put_at = jnp.where(app_new, num_blocks, last)
    slot = (jnp.arange(width)[None, None, :] == put_at[..., None]) & app[..., None]
    table = jnp.where(slot, app_id[..., None], table)
    num_blocks = num_blocks + app_new.astype(jnp.int32)
    device_ref = device_ref.at[jnp.where(app, app_id, pool_size).reshape(-1)].add(1, mode="drop")
    device_ref = device_ref.at[jnp.where(app_cow, cow_src, pool_size).reshape(-1)].add(-1, mode="drop")

    leaving_host = d["valid"] & (swapped_in | swap_ignored)[:, None, None]
    host_ref = add_refs(state.host_ref, state.host_table, leaving_host, -1)
    swap_in_pairs, num_swap_in = compact_pairs(state.host_table, fresh_id, swap_valid & d["is_first"],
                                               cap.max_pairs, (host_size, pool_size))
    copy_pairs, num_copy = compact_pairs(cow_src, app_id, app_cow, cap.max_pairs, (pool_size, pool_size))
    state = state.replace(
        status=jnp.where(admitted | swapped_in, RUNNING, state.status),
        block_table=table, num_blocks=num_blocks, device_ref=device_ref, host_ref=host_ref,
        host_table=jnp.where((swapped_in | swap_ignored)[:, None, None], 0, state.host_table),
    )
    return state, Moves(swap_in_pairs, num_swap_in, copy_pairs, num_copy)
