"""Prefix caching (SPEC A10) as pure functions over a fixed-shape pool: vLLM 0.5.3's
CachedBlockAllocator and LRU evictor, block keys hashed on device.

A pool of size D has the null block 0 (never handed out) and blocks 1..num_active. Blocks
are handed out in id order while never-used ones remain (ids 1..num_used have been used);
every used block is either in use (ref_count > 0) or in the evictor (ref_count == 0). A
block that drops to 0 is not freed: it keeps its key and enters the evictor, so

    num_free = (num_active - num_used) + #evictor        # never used + evictor

`cached` says a block holds a content key that `lookup` can find. A block allocated without
one (vLLM's decode block, keyed by a fresh counter) has `cached` False: it is never shared by
content, but at ref count 0 it enters the evictor like any other block (as in vLLM; it is
garbage there until it is evicted, or promoted while in use).

Keys are two uint32 words of a chained hash of the content (`block_keys`), never of block
ids, so a child block still matches after its parent block was evicted. A collision (two
different prefixes, one key) makes a request share a block holding another prefix's K/V: a
wrong share, exactly as in vLLM, whose key is Python's 64-bit `hash` of the token tuple.
Among n distinct cached prefixes its probability is about n^2 / 2^65 at the full width.

Padding in index arrays is the out-of-range id D with `mode="drop"`, never -1. Transitions
that vLLM runs one block at a time and whose outcome depends on the order (allocation with
evictions, promotion) are a `lax.scan` over the requested entries, each step vectorized over
the pool; `lookup`, `free`, `access` and the evictor's walk are vectorized outright.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

NEVER_ACCESSED = -1.0   # vLLM's DEFAULT_LAST_ACCESSED_TIME
_PROMPT_END = 0xFFFFFFFF  # absorbed where the prompt ends; token ids are < 2^31
_INT_MAX = jnp.iinfo(jnp.int32).max


# ----------------------------------------------------------------------------- keys


def _fmix(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finalizer: every input bit flips each output bit with p ~ 1/2."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _absorb(a: jax.Array, b: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One uint32 into the two-word state; the words cross-feed, so neither lane is
    independent of the other (a 64-bit state, not two 32-bit hashes)."""
    a2 = _fmix(a ^ (t * jnp.uint32(0x9E3779B1)) ^ (b << 7) ^ (b >> 25))
    b2 = _fmix(b + (t ^ jnp.uint32(0x7F4A7C15)) + a2)
    return a2, b2


def block_keys(tokens: jax.Array, num_tokens: jax.Array, prompt_len: jax.Array,
               block_size: int, width: int = 64) -> tuple[jax.Array, jax.Array]:
    """The key of every block of sequences: uint32[..., 2, M] and valid bool[..., M].

    `tokens` int32[..., M * block_size] (ids in [0, 2^31)); `num_tokens`, `prompt_len`
    int32[...]. Block i's key hashes the tokens 0 .. min(num_tokens, (i + 1) * block_size)
    as one stream with a marker where the prompt ends, which is vLLM's `hash_of_block`
    split (prompt[:end], None) inside the prompt and (prompt, outputs[:end - p]) past it:

        tokens   | p0 p1 p2 p3 | p4 p5 ^ o0 | o1 o2 .  . |      (^ marker, prompt_len 6)
        key      | h(p0..p3)   | h(.. p5 ^ o0) | h(.. o2)  |      h chained block by block

    A partial block's key covers the tokens there are (the prompt's partial last block is
    (prompt, ()), marker included). Blocks with no token are not valid. `width` (static,
    1..64) keeps the low bits only: tiny widths force collisions in tests.
    """
    lead, n = tokens.shape[:-1], tokens.shape[-1]
    assert n % block_size == 0 and 1 <= width <= 64
    m = n // block_size
    toks = jnp.moveaxis(tokens.astype(jnp.uint32).reshape(*lead, m, block_size), -2, 0)
    num_tokens, prompt_len = jnp.broadcast_to(num_tokens, lead), jnp.broadcast_to(prompt_len, lead)

    def one_block(state, xs):
        a, b = state
        block_tokens, start = xs
        for j in range(block_size):            # tokens within a block; blocks are scanned
            pos = start + j
            ma, mb = _absorb(a, b, jnp.uint32(_PROMPT_END))
            at_end = pos == prompt_len
            a, b = jnp.where(at_end, ma, a), jnp.where(at_end, mb, b)
            ta, tb = _absorb(a, b, block_tokens[..., j])
            live = pos < num_tokens
            a, b = jnp.where(live, ta, a), jnp.where(live, tb, b)
        return (a, b), jnp.stack([a, b])

    init = (jnp.full(lead, 0x243F6A88, jnp.uint32), jnp.full(lead, 0x85A308D3, jnp.uint32))
    starts = jnp.arange(m, dtype=jnp.int32) * block_size
    _, keys = lax.scan(one_block, init, (toks, starts))          # [M, 2, ...]
    keys = jnp.moveaxis(keys, (0, 1), (-1, -2))                 # [..., 2, M]
    keys = keys & key_mask(width)[:, None]
    return keys, starts < num_tokens[..., None]


def key_mask(width: int) -> jax.Array:
    """uint32[2]: the bits of each word a key of `width` bits keeps."""
    lo_bits, hi_bits = min(width, 32), max(width - 32, 0)
    return jnp.asarray([(1 << lo_bits) - 1, (1 << hi_bits) - 1], jnp.uint32)


def extend_key(key: jax.Array, token: jax.Array, prompt_end: jax.Array,
               width: int = 64) -> jax.Array:
    """The key after one more token: uint32[..., 2] from a block's key (the stream so far).

    `prompt_end` marks the first output token of a prompt that ended on a block boundary
    (elsewhere the marker is already in the key of the prompt's partial last block, see
    `block_keys`). Chained from the stored (possibly truncated) key, so at full width it
    equals `block_keys` on the longer sequence; narrower, it is still a function of content.
    """
    a, b = key[..., 0], key[..., 1]
    ma, mb = _absorb(a, b, jnp.uint32(_PROMPT_END))
    a, b = jnp.where(prompt_end, ma, a), jnp.where(prompt_end, mb, b)
    a, b = _absorb(a, b, token.astype(jnp.uint32))
    return jnp.stack([a, b], axis=-1) & key_mask(width)


# ----------------------------------------------------------------------------- the pool


class PrefixPool(NamedTuple):
    """One cached pool (device or host). D = number of blocks + 1 (block 0 is null).

    Attributes:
      key: uint32[2, D]            content key of a cached block (0 where not cached).
      ref_count: int32[D]          block-table entries pointing at each block.
      last_access: float32[D]      `now` of the last step that scheduled it; -1 never.
      num_hashed_tokens: int32[D]  tokens its key covers, (i + 1) * block_size at index i.
      evict_seq: int32[D]          when it entered the evictor (its order there).
      cached: bool[D]              holds a content key (lookup can find it).
      num_used: int32[]            blocks 1..num_used have been handed out.
      num_active: int32[]          blocks 1..num_active exist in this run.
      clock: int32[]               the next evict_seq.
    """
    key: jax.Array
    ref_count: jax.Array
    last_access: jax.Array
    num_hashed_tokens: jax.Array
    evict_seq: jax.Array
    cached: jax.Array
    num_used: jax.Array
    num_active: jax.Array
    clock: jax.Array


def init_pool(size: int, num_active) -> PrefixPool:
    """An empty pool of `size` = capacity + 1 entries, blocks 1..num_active usable."""
    zeros = jnp.zeros(size, jnp.int32)
    return PrefixPool(key=jnp.zeros((2, size), jnp.uint32), ref_count=zeros,
                      last_access=jnp.full(size, NEVER_ACCESSED, jnp.float32),
                      num_hashed_tokens=zeros, evict_seq=zeros, cached=jnp.zeros(size, bool),
                      num_used=jnp.int32(0), num_active=jnp.asarray(num_active, jnp.int32),
                      clock=jnp.int32(0))


def used_mask(pool: PrefixPool) -> jax.Array:
    ids = jnp.arange(pool.ref_count.shape[0])
    return (ids >= 1) & (ids <= pool.num_used)


def evictor_mask(pool: PrefixPool) -> jax.Array:
    return used_mask(pool) & (pool.ref_count == 0)


def num_free(pool: PrefixPool) -> jax.Array:
    return pool.num_active - pool.num_used + evictor_mask(pool).sum(dtype=jnp.int32)


def lookup(pool: PrefixPool, keys: jax.Array, valid: jax.Array) -> jax.Array:
    """int32[K]: the cached block (in use or in the evictor) holding each key, else D.

    One sort of the pool's keys merged with the queries (a query sorts after a pool entry
    with the same key), then each query reads the last cached pool entry before it.
    """
    size, k = pool.ref_count.shape[0], keys.shape[1]
    findable = used_mask(pool) & pool.cached
    hi = jnp.concatenate([pool.key[1], keys[1]])
    lo = jnp.concatenate([pool.key[0], keys[0]])
    tag = jnp.concatenate([jnp.zeros(size, jnp.int32), jnp.ones(k, jnp.int32)])
    payload = jnp.arange(size + k, dtype=jnp.int32)
    hi, lo, tag, payload = lax.sort((hi, lo, tag, payload), num_keys=3)
    cand = (tag == 0) & jnp.concatenate([findable, jnp.zeros(k, bool)])[payload]
    pos = jnp.arange(size + k, dtype=jnp.int32)
    last = lax.cummax(jnp.where(cand, pos, -1))
    at = jnp.maximum(last, 0)
    hit = (tag == 1) & (last >= 0) & (hi[at] == hi) & (lo[at] == lo)
    found = jnp.where(hit, payload[at], size)
    out = jnp.full(size + k, size, jnp.int32).at[payload].set(found)[size:]
    return jnp.where(valid, out, size)


# ----------------------------------------------------------------------------- the evictor


def _entry_order(pool: PrefixPool) -> jax.Array:
    """Pool ids with the evictor's entries first, in the order they entered it."""
    return jnp.argsort(jnp.where(evictor_mask(pool), pool.evict_seq, _INT_MAX), stable=True)


def _walk(present: jax.Array, last: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """vLLM's LRUEvictor.evict over entries in entry order: (position of the victim, any).

    The walk starts at the first entry, switches to an entry covering more tokens, and stops
    at the first entry accessed later than its current choice. Before it stops, its choice
    is the first entry of the running maximum of tokens (a "record"), so the stop is the
    first entry accessed later than the last record before it.
    """
    n = present.shape[0]
    pos = jnp.arange(n, dtype=jnp.int32)
    toks = jnp.where(present, tokens, -1)
    before = jnp.concatenate([jnp.full(1, -1, toks.dtype), lax.cummax(toks)[:-1]])
    choice = lax.cummax(jnp.where(present & (toks > before), pos, -1))
    prev = jnp.concatenate([jnp.full(1, -1, jnp.int32), choice[:-1]])
    stop = present & (prev >= 0) & (last > last[jnp.maximum(prev, 0)])
    first_stop = jnp.min(jnp.where(stop, pos, n))
    return jnp.maximum(jnp.where(first_stop < n, prev[first_stop], choice[-1]), 0), present.any()


def evict_order(pool: PrefixPool) -> jax.Array:
    """int32[D]: the evictor's blocks in the order repeated evictions give them up, then D.

    When the evictor's access times do not fall along its entry order (the usual case:
    blocks enter it when their group ends), each walk picks the oldest access, then the most
    tokens, then the earliest entry, so one lexsort ranks them all. Otherwise the walks run
    one per block (a scan; each walk vectorized over the pool).
    """
    size = pool.ref_count.shape[0]
    inside = evictor_mask(pool)
    order = _entry_order(pool)
    present, last, toks = inside[order], pool.last_access[order], pool.num_hashed_tokens[order]
    monotone = jnp.all(~present[1:] | (last[1:] >= last[:-1]))
    count = inside.sum()

    def by_sort(_):
        ids = jnp.lexsort((pool.evict_seq, -pool.num_hashed_tokens, pool.last_access, ~inside))
        return ids.astype(jnp.int32)

    def by_walks(_):
        def one(present, _):
            at, any_left = _walk(present, last, toks)
            return present.at[at].set(False), jnp.where(any_left, order[at], size)
        return lax.scan(one, present, None, length=size)[1].astype(jnp.int32)

    ranked = lax.cond(monotone, by_sort, by_walks, None)
    return jnp.where(jnp.arange(size) < count, ranked, size)


# ----------------------------------------------------------------------------- transitions


def allocate_cached(pool: PrefixPool, keys: jax.Array, keyed: jax.Array,
                    num_hashed_tokens: jax.Array, count: jax.Array, by_id: jax.Array | None = None
                    ) -> tuple[PrefixPool, jax.Array, jax.Array]:
    """vLLM's CachedBlockAllocator.allocate for entries 0..count-1, in order.

    Entry j with `keyed[j]` takes the cached block holding `keys[:, j]` (in use: shared; in
    the evictor: taken back), also one an earlier entry of this call allocated; otherwise
    (or unkeyed) a never-used block, lowest id first, else the evictor's victim, which gets
    the key (or none) and `num_hashed_tokens[j]`; its last access is kept, as in vLLM.
    Returns (pool, blocks int32[K] padded with D, ok): ok is False if some entry found no
    free block (callers check the free count first; such an entry gets D).

    An unkeyed block gets an identity instead of a content key, (its id, its evict_seq),
    unique among blocks (vLLM: a fresh integer key), and stays uncached. `by_id[j]` (for
    swaps of unkeyed blocks) looks `keys[:, j]` up as such an identity among uncached blocks
    and gives it to a fresh block: vLLM passes the integer key along, so a swap-in takes the
    device block it left in the evictor back, as a content key would.

    NOTE: a scan over entries, not a ranking: an eviction may take the very block a later
    entry's key would have hit, so later entries depend on earlier ones.
    """
    size = pool.ref_count.shape[0]
    order = _entry_order(pool)
    last, ids = pool.last_access[order], jnp.arange(size)

    def one(carry, xs):
        ref, key, cached, nht, num_used = carry
        k, is_keyed, is_id, tokens, j = xs
        valid = j < count
        used = (ids >= 1) & (ids <= num_used)
        match = (used & (cached == is_keyed) & (key[0] == k[0]) & (key[1] == k[1])
                 & (is_keyed | is_id))
        hit = match.any()
        at, can_evict = _walk((used & (ref == 0))[order], last, nht[order])
        never = num_used < pool.num_active
        fresh = jnp.where(never, num_used + 1, order[at])
        ok = hit | never | can_evict
        block = jnp.where(valid & ok, jnp.where(hit, jnp.argmax(match), fresh), size)
        new = jnp.where(valid & ok & ~hit, block, size)
        identity = jnp.stack([block, pool.evict_seq[jnp.minimum(block, size - 1)]]).astype(jnp.uint32)
        key = key.at[:, new].set(jnp.where(is_keyed | is_id, k, identity), mode="drop")
        cached = cached.at[new].set(is_keyed, mode="drop")
        nht = nht.at[new].set(tokens, mode="drop")
        num_used = num_used + (valid & ~hit & never)
        return (ref.at[block].add(1, mode="drop"), key, cached, nht, num_used), (block, ok | ~valid)

    init = (pool.ref_count, pool.key, pool.cached, pool.num_hashed_tokens, pool.num_used)
    by_id = jnp.zeros_like(keyed) if by_id is None else by_id & ~keyed
    xs = (keys.T, keyed, by_id, num_hashed_tokens, jnp.arange(keys.shape[1]))
    (ref, key, cached, nht, num_used), (blocks, oks) = lax.scan(one, init, xs)
    pool = pool._replace(ref_count=ref, key=key, cached=cached, num_hashed_tokens=nht,
                         num_used=num_used)
    return pool, blocks.astype(jnp.int32), oks.all()


def free(pool: PrefixPool, blocks: jax.Array, mask: jax.Array) -> PrefixPool:
    """Drop one reference per masked entry, in order; a block reaching 0 enters the
    evictor (keeping its key) when its last reference here is dropped.

    Entry j brings its block to 0 when the references dropped so far, itself included,
    equal the block's count: the occurrence rank within equal ids comes from a stable sort.
    """
    size, k = pool.ref_count.shape[0], blocks.shape[0]
    idx = jnp.where(mask, blocks, size).astype(jnp.int32)
    perm = jnp.argsort(idx, stable=True)
    sorted_idx, pos = idx[perm], jnp.arange(k, dtype=jnp.int32)
    run_start = jnp.concatenate([jnp.ones(1, bool), sorted_idx[1:] != sorted_idx[:-1]])
    occurrence = jnp.zeros(k, jnp.int32).at[perm].set(pos - lax.cummax(jnp.where(run_start, pos, 0)))
    ref_at = jnp.take(pool.ref_count, jnp.minimum(idx, size - 1))
    to_zero = mask & (ref_at == occurrence + 1)
    seq = pool.clock + jnp.cumsum(to_zero, dtype=jnp.int32) - 1
    evict_seq = pool.evict_seq.at[jnp.where(to_zero, idx, size)].set(seq, mode="drop")
    return pool._replace(ref_count=pool.ref_count.at[idx].add(-1, mode="drop"),
                         evict_seq=evict_seq, clock=pool.clock + to_zero.sum(dtype=jnp.int32))


def promote(pool: PrefixPool, blocks: jax.Array, keys: jax.Array, mask: jax.Array
            ) -> tuple[PrefixPool, jax.Array]:
    """A decode filled each masked block (ref count 1, its sequence's last): vLLM's
    `_promote_last_block`, in entry order. If the full key is cached (in use or in the
    evictor, also by an earlier entry here) the sequence frees its block, which enters the
    evictor with its old key, and takes the keyed one; else its block gets the key (its
    num_hashed_tokens unchanged, as in vLLM). Returns (pool, the sequences' blocks)."""
    size, ids = pool.ref_count.shape[0], jnp.arange(pool.ref_count.shape[0])

    def one(carry, xs):
        ref, key, cached, evict_seq, clock = carry
        block, k, on = xs
        used = (ids >= 1) & (ids <= pool.num_used)
        match = used & cached & (key[0] == k[0]) & (key[1] == k[1])
        found = on & match.any()
        mine = jnp.where(found, block, size)
        ref = ref.at[mine].add(-1, mode="drop")
        to_zero = found & (ref[jnp.minimum(block, size - 1)] == 0)
        evict_seq = evict_seq.at[jnp.where(to_zero, block, size)].set(clock, mode="drop")
        ref = ref.at[jnp.where(found, jnp.argmax(match), size)].add(1, mode="drop")
        keep = jnp.where(on & ~found, block, size)
        key = key.at[:, keep].set(k, mode="drop")
        cached = cached.at[keep].set(True, mode="drop")
        out = jnp.where(found, jnp.argmax(match), block)
        return (ref, key, cached, evict_seq, clock + to_zero), out

    init = (pool.ref_count, pool.key, pool.cached, pool.evict_seq, pool.clock)
    (ref, key, cached, evict_seq, clock), out = lax.scan(one, init, (blocks, keys.T, mask))
    pool = pool._replace(ref_count=ref, key=key, cached=cached, evict_seq=evict_seq, clock=clock)
    return pool, jnp.where(mask, out, blocks).astype(jnp.int32)


def access(pool: PrefixPool, blocks: jax.Array, mask: jax.Array, now) -> PrefixPool:
    """Stamp the masked blocks (every block of every scheduled sequence) with `now`."""
    idx = jnp.where(mask, blocks, pool.ref_count.shape[0])
    return pool._replace(last_access=pool.last_access.at[idx].set(
        jnp.asarray(now, jnp.float32), mode="drop"))
