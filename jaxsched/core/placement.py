"""Give scheduled groups their device blocks: admission, swap-in, decode slots, copy-on-write.

All of a step's requests are served by one ranking over the free list: decode slots take
the lowest free blocks, then the fresh table entries of admitted and swapped-in groups. An
entry that shares a block with a lower sequence of its group (a forked prompt block) takes
that sequence's new block, so sharing survives swap-in and re-admission.

    block table of a re-admitted forked group (prompt of 2 full blocks + a partial one):
      seq 0 (leader): [ a  b | c0 d0 ]      a, b: the prompt's full blocks, ref count n
      seq 1:          [ a  b | c1 d1 ]      c, d: each sequence's own tokens on top

Most steady-state steps allocate nothing, so `place` is called under a `lax.cond` and the
fresh-table work (admission, swap-in) under another one: a decode step that needs no new
block pays for neither.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxsched.core import batching
from jaxsched.core.block_pool import (add_refs, exclusive_cumsum, free_list, mask_rank, on_rows,
                                      put_rows, take_ranked, write_pairs)
from jaxsched.core.config import Capacity

# Rows of the step's block-pair lists, int32[3, P, 2] (see SchedulerOutput).
SWAP_OUT, SWAP_IN, COPY = 0, 1, 2


def pair_rows(cap: Capacity) -> int:
    """Rows P of each block-pair list: the most pairs one step can produce.

    A swap moves each block to a block of its own on the other side, so a step swaps at
    most min(device, host) blocks each way; a copy-on-write is at most one per sequence.
    The lists are padded outputs of every step, so a tight bound saves writing them.
    """
    swaps = min(cap.num_device_blocks, cap.num_host_blocks)
    return max(swaps, cap.num_slots * cap.max_seqs_per_group, 1)


def no_pairs(cap: Capacity) -> jax.Array:
    """Empty pair lists int32[3, P, 2], each padded with (src pool size, dst pool size)."""
    device_size, host_size = cap.num_device_blocks + 1, cap.num_host_blocks + 1
    pad = jnp.asarray([[device_size, host_size], [host_size, device_size],
                       [device_size, device_size]], jnp.int32)
    return jnp.broadcast_to(pad[:, None, :], (3, pair_rows(cap), 2))


class Blocks(NamedTuple):
    """The block bookkeeping a step may change (slot space)."""
    block_table: jax.Array     # int32[G, S, M]
    num_blocks: jax.Array      # int32[G, S]
    device_ref: jax.Array      # int32[D]
    host_ref: jax.Array        # int32[H]


def _admitted_entries(seq_alive, num_tokens, leader, n_live, prompt_blocks, admitted, width,
                      block_size):
    """(valid, holder, num_blocks, rank) of the new tables of admitted groups; prompt blocks
    shared (SPEC B1).

    A sequence's own (fresh) entries are one run of positions [lo, num_blocks): lo is 0
    for the leader and the shared prompt blocks for the others. So `rank`, the number of
    fresh entries before each one in flat order, is a prefix sum over the G * S rows plus
    the position in the run, not one over all G * S * M entries.
    """
    s = seq_alive.shape[1]
    seq = jnp.arange(s, dtype=jnp.int32)[None, :, None]
    pos = jnp.arange(width)[None, None, :]
    num_blocks = jnp.where(seq_alive, (num_tokens + block_size - 1) // block_size, 0)
    is_leader = seq[..., 0] == leader[:, None]
    shared = jnp.where((n_live > 1)[:, None] & ~is_leader, prompt_blocks[:, None], 0)
    holder = jnp.where(pos < shared[..., None], leader[:, None, None].astype(jnp.int32), seq)
    valid = admitted[:, None, None] & seq_alive[..., None] & (pos < num_blocks[..., None])
    own = jnp.where(admitted[:, None] & seq_alive, jnp.maximum(num_blocks - shared, 0), 0)
    row_start = exclusive_cumsum(own.reshape(-1), bound=own.size * width).reshape(own.shape)
    rank = row_start[..., None] + pos - shared[..., None]
    return valid, holder, num_blocks, rank


def _fresh_tables(blk: Blocks, pairs, seq_alive, num_tokens, d, share, blocks, first_rank,
                  admitted, swapped_in, swap_ignored, block_size):
    """New tables of admitted and swapped-in groups; swapped groups leave the host pool (the
    host blocks their rows held are released, the rows of ignored ones cleared).

    Only the rows of the groups that move are worked on (`on_rows`: a step admits or swaps
    in a few groups). Steps that only admit (the common case) rank the fresh entries row
    by row and skip the host pool and the swap-in pair list (a `lax.cond`).
    """
    _, s, width = blk.block_table.shape
    seq = jnp.arange(s, dtype=jnp.int32)[None, :, None]

    def rows(at, carry, table, num_blocks, valid, holder, is_first, alive, tokens, admitted,
             swapped_in, swap_ignored, leader, n_live, prompt_blocks):
        # `taken`: the fresh entries of the rows before these, which took the blocks ranked
        # first; `count`: the swap-in pairs written for them.
        out, pairs, count, taken = carry
        host_rows = table           # a swapped group's row holds its host blocks
        adm_valid, adm_holder, adm_blocks, adm_rank = _admitted_entries(
            alive, tokens, leader, n_live, prompt_blocks, admitted, width, block_size)
        swap_valid = valid & swapped_in[:, None, None]
        swap_fresh = swap_valid & is_first
        adm_fresh = adm_valid & (adm_holder == seq)
        fresh = adm_fresh | swap_fresh
        new_valid = adm_valid | swap_valid
        holder = jnp.where(admitted[:, None, None], adm_holder, holder)
        leaving = swapped_in | swap_ignored

        def with_swaps(pairs, count):
            # Ranks in flat order over the rows taken are ranks over the table.
            fresh_id = take_ranked(blocks, first_rank + taken + mask_rank(fresh), fresh)
            host_ref = add_refs(out.host_ref, host_rows, valid & leaving[:, None, None], -1)
            pairs, count = write_pairs(pairs, SWAP_IN, host_rows, fresh_id, swap_fresh, count=count)
            return fresh_id, host_ref, pairs, count

        def admissions_only(pairs, count):
            return take_ranked(blocks, first_rank + taken + adm_rank, adm_fresh), out.host_ref, pairs, count

        fresh_id, host_ref, pairs, count = batching.cond(leaving.any(), with_swaps, admissions_only,
                                                         pairs, count, same=True)
        mapped = jnp.where(new_valid, jnp.take_along_axis(fresh_id, holder, axis=1), 0)
        device_ref = add_refs(out.device_ref, mapped, new_valid, 1)
        table = jnp.where((admitted | leaving)[:, None, None], mapped, table)
        num_blocks = jnp.where(admitted[:, None], adm_blocks, num_blocks)
        out = Blocks(put_rows(out.block_table, at, table), put_rows(out.num_blocks, at, num_blocks),
                     device_ref, host_ref)
        return out, pairs, count, taken + fresh.sum(dtype=jnp.int32)

    blk, pairs, count, _ = on_rows(
        admitted | swapped_in | swap_ignored, rows, (blk, pairs, jnp.int32(0), jnp.int32(0)),
        blk.block_table, blk.num_blocks, *share, seq_alive, num_tokens, admitted, swapped_in,
        swap_ignored, d.leader, d.n_live, d.prompt_blocks)
    return blk, pairs, count


def _appends(d: dict, decoding):
    """(new block, copy-on-write, either) per sequence of the decoding groups."""
    decoding = decoding[:, None]
    app_new, app_cow = d.need_new & decoding, d.cow & decoding
    return app_new, app_cow, app_new | app_cow


def _apply_appends(blk: Blocks, pairs, app_new, app_cow, app_id):
    """Put each appended block in its table slot: after the last entry for a new block, over
    the shared last entry for copy-on-write (whose source loses a reference)."""
    g, s, width = blk.block_table.shape
    pool_size = blk.device_ref.shape[0]
    app = app_new | app_cow
    table, num_blocks = blk.block_table, blk.num_blocks
    last = jnp.maximum(num_blocks - 1, 0)
    cow_src = jnp.take_along_axis(table, last[..., None], axis=2)[..., 0]
    put_at = jnp.where(app_new, num_blocks, last)
    slot = (jnp.arange(width)[None, None, :] == put_at[..., None]) & app[..., None]
    table = jnp.where(slot, app_id[..., None], table)
    num_blocks = num_blocks + app_new.astype(jnp.int32)
    # One scatter: +1 for every handed-out block, -1 for every copied-from shared block.
    idx = jnp.concatenate([jnp.where(app, app_id, pool_size).reshape(-1),
                           jnp.where(app_cow, cow_src, pool_size).reshape(-1)])
    delta = jnp.concatenate([jnp.ones((g * s,), jnp.int32), jnp.full((g * s,), -1, jnp.int32)])
    device_ref = blk.device_ref.at[idx].add(delta, mode="drop")
    if s == 1:       # one sequence per group never shares a block
        num_copy = jnp.int32(0)
    else:
        pairs, num_copy = batching.cond(app_cow.any(),
                                        lambda pairs: write_pairs(pairs, COPY, cow_src, app_id, app_cow),
                                        lambda pairs: (pairs, jnp.int32(0)), pairs, same=True)
    return Blocks(table, num_blocks, device_ref, blk.host_ref), pairs, num_copy


def append_slots(blk: Blocks, pairs, d: dict, decoding, num_active: jax.Array):
    """Decode slots only (no group admitted or swapped in): `place` without fresh tables."""
    app_new, app_cow, app = _appends(d, decoding)
    app_id = take_ranked(free_list(blk.device_ref, num_active), mask_rank(app), app)
    return _apply_appends(blk, pairs, app_new, app_cow, app_id)


def place(blk: Blocks, pairs, seq_alive, num_tokens, d: dict, share, admitted,
          swapped_in, run_served, swap_ignored, num_active: jax.Array, block_size: int):
    """Allocate the step's blocks: decode slots first, then fresh tables (lowest ids first).

    `share` is (valid, holder, is_first) of the step-start tables (block_pool.first_holder).
    Returns the new blocks, the pair lists with swap-in and copy rows written, and the
    numbers of swap-in and copy pairs.
    """
    app_new, app_cow, app = _appends(d, (run_served | swapped_in) & ~d.in_prefill)
    blocks = free_list(blk.device_ref, num_active)
    app_id = take_ranked(blocks, mask_rank(app), app)

    def fresh_branch(b, pairs):
        return _fresh_tables(b, pairs, seq_alive, num_tokens, d, share, blocks,
                             app.sum(dtype=jnp.int32), admitted, swapped_in, swap_ignored,
                             block_size)

    blk, pairs, num_swap_in = batching.cond((admitted | swapped_in | swap_ignored).any(), fresh_branch,
                                            lambda b, pairs: (b, pairs, jnp.int32(0)), blk, pairs,
                                            same=True)
    blk, pairs, num_copy = _apply_appends(blk, pairs, app_new, app_cow, app_id)
    return blk, pairs, num_swap_in, num_copy
