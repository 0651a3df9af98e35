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
import numpy as np
from jax import lax

from jaxsched.core import batching


def _triangle(n: int, dtype) -> np.ndarray:
    """[n, n] with ones where row <= col: x @ it is a prefix sum.

    A host constant, not an iota comparison: XLA:CPU does not fold the comparison, and each
    use compiled to a kernel of its own (55 of the sweep chunk's 859)."""
    return np.triu(np.ones((n, n), dtype))


def _dot_cumsum(x: jax.Array, dtype) -> jax.Array:
    """Inclusive prefix sum over the last axis: up to 64 entries one masked reduction, past
    that two levels of triangular matmuls."""
    n = x.shape[-1]
    if n <= 64:
        # A masked int32 reduction over the minor axis: XLA fuses the iota comparison and
        # x's producer into it, one kernel where the dot was two or three (the sweep's
        # chunk: 476 kernels -> 451). It runs 13 against 44 ns at 8 entries, 288 against
        # 174 at 64 (float32 over the major axis took 600).
        j, i = lax.broadcasted_iota(jnp.int32, (n, n), 0), lax.broadcasted_iota(jnp.int32, (n, n), 1)
        return jnp.where(i <= j, x.astype(jnp.int32)[..., None, :], 0).sum(-1, dtype=jnp.int32).astype(dtype)
    dot = lambda a, b: jnp.matmul(a, b, preferred_element_type=dtype)
    block = 32 if n <= 2048 else 64
    pad = -n % block
    y = jnp.pad(x.astype(dtype), [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    y = dot(y.reshape(*x.shape[:-1], -1, block), _triangle(block, dtype))
    totals = y[..., -1]
    before = _dot_cumsum(totals, dtype) - totals
    return (y + before[..., None]).reshape(*x.shape[:-1], -1)[..., :n]


def cumsum(x: jax.Array, axis: int = -1, bound: int | None = None) -> jax.Array:
    """Inclusive int32 prefix sum (exact; wraps like int32 addition).

    Up to 64 entries a masked int32 reduction (one kernel); past that, `bound`, a static
    upper bound on every |prefix sum|, lets sums below 2**24 run as float32 matmuls (exact
    there, and about twice as fast as integer ones on CPU).

    NOTE: `jnp.cumsum` lowers to a `reduce_window` that is slow on XLA:CPU (10x at 8192
    elements, worse for several rows), and `lax.associative_scan` emits dozens of tiny
    fusions that double compile time. Blocked triangular matmuls are as fast as the scan and
    compile to a handful of ops.
    """
    exact_f32 = bound is not None and bound < 2**24
    x = jnp.moveaxis(x.astype(jnp.int32), axis, -1)
    out = _dot_cumsum(x, jnp.float32 if exact_f32 else jnp.int32).astype(jnp.int32)
    return jnp.moveaxis(out, -1, axis)


def mask_rank(mask: jax.Array) -> jax.Array:
    """int32, same shape: number of True entries before each one in flat (row-major) order."""
    flat = mask.reshape(-1).astype(jnp.int32)
    return (cumsum(flat, bound=flat.size) - flat).reshape(mask.shape)


def exclusive_cumsum(x: jax.Array, axis: int = -1, bound: int | None = None) -> jax.Array:
    x = x.astype(jnp.int32)
    return cumsum(x, axis=axis, bound=bound) - x


def cummin(x: jax.Array, axis: int = -1) -> jax.Array:
    """Inclusive prefix minimum."""
    return lax.cummin(x, axis=axis % x.ndim)


def first_true(mask: jax.Array, default: jax.Array | int) -> jax.Array:
    """Index of the first True in a 1-D mask, or `default` when there is none."""
    size = mask.shape[0]
    first = jnp.min(jnp.where(mask, jnp.arange(size, dtype=jnp.int32), size))
    return jnp.where(first < size, first, default).astype(jnp.int32)


def free_mask(ref_count: jax.Array, num_active: jax.Array) -> jax.Array:
    """bool[num_blocks]: blocks that may be handed out."""
    ids = jnp.arange(ref_count.shape[0])
    return (ref_count == 0) & (ids >= 1) & (ids <= num_active)


def num_free(ref_count: jax.Array, num_active: jax.Array) -> jax.Array:
    return free_mask(ref_count, num_active).sum(dtype=jnp.int32)


def free_list(ref_count: jax.Array, num_active: jax.Array) -> jax.Array:
    """int32[num_blocks]: free block ids, lowest first, padded with the out-of-range id."""
    return true_indices(free_mask(ref_count, num_active))


def true_indices(mask: jax.Array) -> jax.Array:
    """int32[n] for a bool[n] mask: the indices of its True entries in order, padded with n
    (a ranking, not a sort: XLA:CPU's sort thunk cannot be serialized)."""
    size = mask.shape[0]
    ids = jnp.arange(size, dtype=jnp.int32)
    return jnp.full((size,), size, jnp.int32).at[jnp.where(mask, mask_rank(mask), size)].set(ids, mode="drop")


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
    # NOTE: S is small (the largest n), so the S * (S - 1) / 2 pairs are unrolled: one fused
    # kernel over [G, M] rows, where an [G, S, S, M] comparison and an argmax over its
    # middle axis cost ~50 us a step at 128 slots on CPU.
    rows = []
    for me in range(s):
        holder = jnp.full(table.shape[:1] + table.shape[2:], me, jnp.int32)
        for other in reversed(range(me)):        # the lowest match is written last
            same = (table[:, me] == table[:, other]) & valid[:, me] & valid[:, other]
            holder = jnp.where(same, other, holder)
        rows.append(holder)
    holder = jnp.stack(rows, axis=1)
    return holder, holder == jnp.arange(s)[None, :, None]


# Table work goes over the rows of this many groups at a time (`on_rows`).
FEW_GROUPS = 8


def on_rows(groups: jax.Array | None, fn, carry, *tables: jax.Array):
    """`carry = fn(at, carry, *rows)` over the rows of `groups` (bool[G]; None: all) of
    `tables`, arrays whose leading axis is the groups and of which only those rows matter to
    fn: a scatter of their masked entries, a packing in flat order, a rewrite of their rows.
    A row of zeros (nothing masked) must change nothing. `at` is None when fn gets the whole
    tables at once, else the int32 rows it got (out of range for padding): fn writes rows
    back into its carry with `put_rows(table, at, rows)`, and whatever it ranks in flat
    order it ranks after what the carry counted so far.

    NOTE: XLA's scatter walks its updates one by one, masked or not: every entry of a
    [G, S, M] table is about 10 us a step at 128 slots, 0.6 ms for a sweep's batch of 64 runs.
    A step admits, forks, finishes, preempts or swaps a few groups, so fn gets the rows of
    FEW_GROUPS of them at a time, in order, padded with rows of zeros: one trip for most
    steps, none for a step that marks none. The trips are a loop rather than a second,
    whole-table fn under a `lax.cond` for steps that mark more: with the loop the sweep's
    chunk is 360 kernels, not 383 (traced and lowered in 0.8 s, not 1.1, in a probe). In a
    batch of runs the loop takes the trips the run that needs most needs
    (`batching.fori_loop`); without skips, fn gets the whole tables.
    """
    g = tables[0].shape[0]
    if groups is None or g <= FEW_GROUPS or not batching.skipping():
        return fn(None, carry, *tables)
    trips = -(-g // FEW_GROUPS)
    order = jnp.pad(true_indices(groups), (0, trips * FEW_GROUPS - g), constant_values=g)

    def trip(i, carry):
        rows = lax.dynamic_slice_in_dim(order, i * FEW_GROUPS, FEW_GROUPS)
        return fn(rows, carry, *(jnp.take(x, rows, axis=0, mode="fill", fill_value=0) for x in tables))

    marked = groups.sum(dtype=jnp.int32)
    return batching.fori_loop((marked + FEW_GROUPS - 1) // FEW_GROUPS, trip, carry)


def put_rows(table: jax.Array, at: jax.Array | None, rows: jax.Array) -> jax.Array:
    """`table` with the rows `on_rows` handed out replaced by `rows` (all of it when `at` is None)."""
    return rows if at is None else table.at[at].set(rows, mode="drop")


def add_refs(ref_count: jax.Array, table: jax.Array, mask: jax.Array, delta,
             groups: jax.Array | None = None) -> jax.Array:
    """Add `delta` (an int, or ints shaped as `mask`) to the count of every block referenced
    by a masked entry; `groups` (bool[G]) marks the only rows with masked entries (`on_rows`)."""
    size = ref_count.shape[0]
    delta = jnp.asarray(delta, jnp.int32)

    def scatter(_, ref_count, table, mask, *per_entry):
        idx = jnp.where(mask, table, size).reshape(-1)
        add = jnp.broadcast_to(per_entry[0] if per_entry else delta, mask.shape).reshape(-1)
        return ref_count.at[idx].add(add, mode="drop")

    return on_rows(groups, scatter, ref_count, table, mask, *((delta,) if delta.ndim else ()))


def write_pairs(pairs: jax.Array, row: int, src: jax.Array, dst: jax.Array, mask: jax.Array,
                groups: jax.Array | None = None, count=0) -> tuple[jax.Array, jax.Array]:
    """Pack masked (src, dst) pairs, in flat order, into the padded list pairs[row] after
    the first `count`; `groups` (bool, the leading axis) marks the only rows with masked
    entries (`on_rows`).

    `pairs` is int32[R, P, 2], already padded; returns it and the number of pairs in the row.
    """
    def pack(_, carry, src, dst, mask):
        pairs, count = carry
        mask = mask.reshape(-1)
        where_to = jnp.where(mask, count + mask_rank(mask), pairs.shape[1])
        update = jnp.stack([src.reshape(-1), dst.reshape(-1)], axis=-1)
        return pairs.at[row, where_to].set(update, mode="drop"), count + mask.sum(dtype=jnp.int32)

    return on_rows(groups, pack, (pairs, jnp.asarray(count, jnp.int32)), src, dst, mask)
