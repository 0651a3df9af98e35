"""Reference-counted block pools, allocation by ranking, and block-table bookkeeping.

A pool is an int32 vector of reference counts: entry b counts the block-table entries that
point at block b. Block 0 is the null block: never free, never handed out, and the value of
every unused table entry. Blocks at or above the active count (a per-run limit) are never
free either, so one compiled capacity serves smaller caches.

Sharing is position-aligned: a fork copies the parent's table, so two sequences of a group
share block b only at the same table position. "First holder" of an entry is the lowest
sequence of the group holding that block at that position; counting first holders counts
unique blocks.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
    x = x.astype(jnp.int32)
    return jnp.cumsum(x, axis=axis) - x


def first_true(mask: jax.Array, default: jax.Array | int) -> jax.Array:
    """Index of the first True in a 1-D mask, or `default` when there is none."""
    return jnp.where(mask.any(), jnp.argmax(mask), default).astype(jnp.int32)


def free_mask(ref_count: jax.Array, num_active: jax.Array) -> jax.Array:
    """bool[num_blocks]: blocks that may be handed out."""
    ids = jnp.arange(ref_count.shape[0])
    return (ref_count == 0) & (ids >= 1) & (ids <= num_active)


def num_free(ref_count: jax.Array, num_active: jax.Array) -> jax.Array:
    return free_mask(ref_count, num_active).sum(dtype=jnp.int32)


def free_list(ref_count: jax.Array, num_active: jax.Array) -> jax.Array:
    """int32[num_blocks]: free block ids, lowest first, padded with the out-of-range id."""
    size = ref_count.shape[0]
    free = free_mask(ref_count, num_active)
    rank = exclusive_cumsum(free)
    ids = jnp.arange(size, dtype=jnp.int32)
    return jnp.full((size,), size, jnp.int32).at[jnp.where(free, rank, size)].set(ids, mode="drop")


def take_ranked(blocks: jax.Array, rank: jax.Array, mask: jax.Array) -> jax.Array:
    """blocks[rank] where mask, else the null block 0."""
    got = jnp.take(blocks, jnp.clip(rank, 0, blocks.shape[0] - 1))
    return jnp.where(mask, got, 0)


def entry_valid(num_blocks: jax.Array, seq_mask: jax.Array, width: int) -> jax.Array:
    """bool[G, S, M]: table entries in use."""
    return seq_mask[..., None] & (jnp.arange(width) < num_blocks[..., None])


def first_holder(table: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For each entry, the lowest sequence of its group with the same block at that position.

    Returns (holder int32[G, S, M], is_first bool[G, S, M]); invalid entries are their own holder.
    """
    s = table.shape[1]
    same = (table[:, :, None, :] == table[:, None, :, :]) & valid[:, :, None, :] & valid[:, None, :, :]
    earlier = jnp.arange(s)[None, :] <= jnp.arange(s)[:, None]     # [s_self, s_other]: other <= self
    match = same & earlier[None, :, :, None]
    holder = jnp.argmax(match, axis=2).astype(jnp.int32)           # lowest matching other
    holder = jnp.where(valid, holder, jnp.arange(s)[None, :, None])
    return holder, holder == jnp.arange(s)[None, :, None]


def unique_blocks(table: jax.Array, valid: jax.Array) -> jax.Array:
    """int32[G]: distinct blocks each group holds."""
    _, is_first = first_holder(table, valid)
    return (is_first & valid).sum(axis=(1, 2), dtype=jnp.int32)


def add_refs(ref_count: jax.Array, table: jax.Array, mask: jax.Array, delta: int) -> jax.Array:
    """Add `delta` to the count of every block referenced by a masked entry."""
    idx = jnp.where(mask, table, ref_count.shape[0])
    return ref_count.at[idx.reshape(-1)].add(delta, mode="drop")


def compact_pairs(src: jax.Array, dst: jax.Array, mask: jax.Array, size: int,
                  pad: tuple[int, int]) -> tuple[jax.Array, jax.Array]:
    """Pack masked (src, dst) pairs, in flat order, into int32[size, 2] padded with `pad`."""
    mask = mask.reshape(-1)
    rank = exclusive_cumsum(mask)
    where_to = jnp.where(mask, rank, size)
    pairs = jnp.broadcast_to(jnp.asarray(pad, jnp.int32), (size, 2))
    pairs = pairs.at[where_to, 0].set(src.reshape(-1), mode="drop")
    pairs = pairs.at[where_to, 1].set(dst.reshape(-1), mode="drop")
    return pairs, mask.sum(dtype=jnp.int32)
