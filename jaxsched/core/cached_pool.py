"""Group-sized block work with prefix caching (SPEC A10), for core/cached_step.py's walks.

Each function applies vLLM's block manager to one group (a traced slot index `g`) of a `Ctx`
(the pools as prefix_cache.PrefixPools, the tables, the pair lists), vectorized over the
group's blocks and the pool: allocation by key, appends (new block, promotion,
copy-on-write), preemption by recompute or swap, swap-in, the host blocks of an ignored
swapped group.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxsched.core import prefix_cache as pc
from jaxsched.core.block_pool import add_refs, first_holder, mask_rank
from jaxsched.core.placement import COPY, SWAP_IN, SWAP_OUT

class Ctx(NamedTuple):
    """The block state the walks change, group by group."""
    dev: pc.PrefixPool
    host: pc.PrefixPool
    table: jax.Array          # int32[G, S, M] device blocks, or host blocks of swapped groups
    num_blocks: jax.Array     # int32[G, S]
    pairs: jax.Array          # int32[3, P, 2] swap-out, swap-in, copy
    counts: jax.Array         # int32[3] pairs written in each list


class Step(NamedTuple):
    """What does not change during a step: sequence contents and sizes."""
    seq_key: jax.Array        # uint32[G, S, 2, M]
    alive: jax.Array          # bool[G, S]
    num_tokens: jax.Array     # int32[G, S]
    block_size: int


def cond(pred, work, ctx):
    """`work(ctx)` if `pred`, else ctx."""
    return lax.cond(pred, work, lambda c: c, ctx)


def _push_pairs(ctx: Ctx, row: int, src, dst, mask) -> Ctx:
    """Append masked (src, dst) pairs, in flat order, to list `row`."""
    mask = mask.reshape(-1)
    at = jnp.where(mask, ctx.counts[row] + mask_rank(mask), ctx.pairs.shape[1])
    pairs = ctx.pairs.at[row, at].set(jnp.stack([src.reshape(-1), dst.reshape(-1)], -1), mode="drop")
    return ctx._replace(pairs=pairs, counts=ctx.counts.at[row].add(mask.sum(dtype=jnp.int32)))


def _allocate(pool, keys, keyed, hashed, valid, by_id=None):
    """allocate_cached for the valid entries (flat order) of a [K] list; 0 where invalid."""
    k = valid.shape[0]
    rank = jnp.where(valid, mask_rank(valid), k)
    src = jnp.clip(jnp.full((k,), k, jnp.int32).at[rank].set(jnp.arange(k, dtype=jnp.int32),
                                                              mode="drop"), 0, k - 1)
    pool, got, _ = pc.allocate_cached(pool, keys[:, src], keyed[src], hashed[src],
                                      valid.sum(dtype=jnp.int32),
                                      None if by_id is None else by_id[src])
    return pool, jnp.where(valid, got[jnp.clip(rank, 0, k - 1)], 0)


def _valid(ctx: Ctx, g) -> jax.Array:
    """bool[S, M]: table entries of group g's sequences (live or not: vLLM frees them all)."""
    width = ctx.table.shape[2]
    return jnp.arange(width)[None, :] < ctx.num_blocks[g][:, None]


def admit(ctx: Ctx, st: Step, g) -> Ctx:
    """Allocate every block of every live sequence of group g by its content key (SPEC A10:
    in use: shared; in the evictor: taken back; else a fresh or evicted block)."""
    s, width = st.alive.shape[1], ctx.table.shape[2]
    need = jnp.where(st.alive[g], (st.num_tokens[g] + st.block_size - 1) // st.block_size, 0)
    valid = jnp.arange(width)[None, :] < need[:, None]                          # [S, M]
    keys = jnp.moveaxis(st.seq_key[g], 1, 0).reshape(2, s * width)
    hashed = jnp.broadcast_to((jnp.arange(width, dtype=jnp.int32) + 1) * st.block_size, (s, width))
    dev, blocks = _allocate(ctx.dev, keys, jnp.ones((s * width,), bool), hashed.reshape(-1),
                            valid.reshape(-1))
    return ctx._replace(dev=dev, table=ctx.table.at[g].set(blocks.reshape(s, width)),
                        num_blocks=ctx.num_blocks.at[g].set(need))


def _move(src: pc.PrefixPool, dst: pc.PrefixPool, table, valid):
    """Move a group's blocks (table [S, M]) between pools, keys kept: each distinct block is
    allocated in `dst` by its key (sharing or taking back what `dst` holds; an unkeyed block
    by its identity), then every source entry is freed. Returns (src, dst, new table,
    first-holder mask)."""
    s, width = table.shape
    holder, is_first = first_holder(table[None], valid[None])
    holder, is_first = holder[0], is_first[0] & valid
    ids = jnp.clip(table.reshape(-1), 0, src.ref_count.shape[0] - 1)
    dst, fresh = _allocate(dst, src.key[:, ids], src.cached[ids], src.num_hashed_tokens[ids],
                           is_first.reshape(-1), ~src.cached[ids])
    mapped = jnp.where(valid, jnp.take_along_axis(fresh.reshape(s, width), holder, axis=0), 0)
    dst = dst._replace(ref_count=add_refs(dst.ref_count, mapped, valid & ~is_first, 1))
    src = pc.free(src, table.reshape(-1), valid.reshape(-1))
    return src, dst, mapped, is_first


def preempt(ctx: Ctx, g, swap) -> Ctx:
    """Recompute (every block freed into the evictor, keys kept) or swap out group g."""
    valid = _valid(ctx, g)

    def recompute(ctx):
        dev = pc.free(ctx.dev, ctx.table[g].reshape(-1), valid.reshape(-1))
        return ctx._replace(dev=dev, table=ctx.table.at[g].set(0),
                            num_blocks=ctx.num_blocks.at[g].set(0))

    def swap_out(ctx):
        # The row now holds the host blocks (a swapped group's table is on the host).
        dev, host, mapped, first = _move(ctx.dev, ctx.host, ctx.table[g], valid)
        ctx = _push_pairs(ctx, SWAP_OUT, ctx.table[g], mapped, first)
        return ctx._replace(dev=dev, host=host, table=ctx.table.at[g].set(mapped))

    return lax.cond(swap, swap_out, recompute, ctx)


def swap_in(ctx: Ctx, st: Step, g) -> Ctx:
    """Group g's host blocks back onto the device by key, then its appends."""
    valid = _valid(ctx, g)
    host, dev, mapped, first = _move(ctx.host, ctx.dev, ctx.table[g], valid)
    ctx = _push_pairs(ctx, SWAP_IN, ctx.table[g], mapped, first)
    ctx = ctx._replace(dev=dev, host=host, table=ctx.table.at[g].set(mapped))
    return append(ctx, st, g)


def drop_host(ctx: Ctx, g) -> Ctx:
    """SPEC B2: an ignored swapped group's host blocks enter the host evictor."""
    host = pc.free(ctx.host, ctx.table[g].reshape(-1), _valid(ctx, g).reshape(-1))
    return ctx._replace(host=host, table=ctx.table.at[g].set(0),
                        num_blocks=ctx.num_blocks.at[g].set(0))


def append(ctx: Ctx, st: Step, g) -> Ctx:
    """vLLM's append_slots for each live sequence of group g, in order (a scan over S):
    a new block (keyed when the last block is full), promotion of a solely held last block
    that this token fills, or copy-on-write of a shared last block."""
    bs = st.block_size
    width = ctx.table.shape[2]

    def one(ctx, s):
        nt, nb = st.num_tokens[g, s], ctx.num_blocks[g, s]
        need = (nt + bs - 1) // bs
        full = nt % bs == 0
        key = st.seq_key[g, s, :, jnp.clip(need - 1, 0, width - 1)]
        last_at = jnp.maximum(nb - 1, 0)
        last = ctx.table[g, s, last_at]
        new = st.alive[g, s] & (nb < need)
        shared = st.alive[g, s] & ~new & (ctx.dev.ref_count[last] > 1)
        promote = st.alive[g, s] & ~new & ~shared & full
        dev, got, _ = pc.allocate_cached(ctx.dev, key[:, None], full[None], (need * bs)[None],
                                         (new | shared).astype(jnp.int32))
        dev = pc.free(dev, last[None], shared[None])
        dev, promoted = pc.promote(dev, last[None], key[:, None], promote[None])
        put_at = jnp.where(new, nb, last_at)
        block = jnp.where(promote, promoted[0], got[0])
        row = jnp.where((jnp.arange(width) == put_at) & (new | shared | promote), block,
                        ctx.table[g, s])
        ctx = ctx._replace(dev=dev, table=ctx.table.at[g, s].set(row),
                           num_blocks=ctx.num_blocks.at[g, s].add(new.astype(jnp.int32)))
        return _push_pairs(ctx, COPY, last[None], got[:1], shared[None]), None

    return lax.scan(one, ctx, jnp.arange(st.alive.shape[1]))[0]
