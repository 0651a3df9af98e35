"""The jitted prefix-cache primitives (jaxsched/core/prefix_cache.py) against the reference's
CachedBlockPool: the same operations give the same blocks, counts, keys and evictor order;
the pools' invariants hold after every operation, also with a hash forced tiny."""
from __future__ import annotations

import copy
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxsched.core import prefix_cache as pc
from jaxsched.sim.reference import SAMPLED_TOKEN, BlockManager, CachedBlockPool, Sequence

SIZE, K = 9, 6          # pool: null block + 8; entries per call (one compile per shape)
BS, M = 2, 4            # block size, blocks per sequence in the key tests


def _jit(fn, **kw):
    return jax.jit(chex.assert_max_traces(fn, n=1), **kw)


ALLOCATE, FREE, PROMOTE = _jit(pc.allocate_cached), _jit(pc.free), _jit(pc.promote)
ACCESS, LOOKUP, EVICT_ORDER = _jit(pc.access), _jit(pc.lookup), _jit(pc.evict_order)
NUM_FREE = _jit(pc.num_free)
KEYS = _jit(lambda tokens, lens, prompts: pc.block_keys(tokens, lens, prompts, BS))
TINY = 3                 # bits of the forced-tiny hash
TINY_KEYS = _jit(lambda tokens, lens, prompts: pc.block_keys(tokens, lens, prompts, BS, TINY))
NUM_SEQS = 8             # sequences per block_keys call


def make_pools(num_active: int):
    return CachedBlockPool(num_active), pc.init_pool(SIZE, num_active)


def words(key) -> tuple[int, int]:
    """Reference keys of the differential test are (lo, hi) int pairs; None is unkeyed."""
    return (0, 0) if key is None else key


def pad(values, fill, dtype):
    return jnp.asarray(list(values) + [fill] * (K - len(values)), dtype)


def key_array(keys) -> jax.Array:
    return jnp.asarray(np.array([words(k) for k in keys] + [(0, 0)] * (K - len(keys)),
                                np.uint32).T.reshape(2, K))


def check_pool(pool: pc.PrefixPool) -> None:
    """A key maps to at most one block; evictor blocks have ref count 0; free = never used
    + evictor; nothing past num_used is held."""
    p = jax.device_get(pool)
    ids = np.arange(SIZE)
    used = (ids >= 1) & (ids <= p.num_used)
    assert (p.ref_count >= 0).all() and (p.ref_count[~used] == 0).all()
    assert 0 <= p.num_used <= p.num_active
    cached_keys = [tuple(p.key[:, b]) for b in ids[used & p.cached]]
    assert len(cached_keys) == len(set(cached_keys))
    evictor = used & (p.ref_count == 0)
    assert int(NUM_FREE(pool)) == p.num_active - p.num_used + evictor.sum()
    assert int(NUM_FREE(pool)) == p.num_active - (p.ref_count > 0).sum()
    assert len(set(p.evict_seq[evictor])) == evictor.sum()


def assert_same(ref: CachedBlockPool, pool: pc.PrefixPool) -> None:
    p = jax.device_get(pool)
    n = ref.num_blocks
    assert p.num_used == ref.num_used and int(NUM_FREE(pool)) == ref.num_free
    np.testing.assert_array_equal(p.ref_count[1:n + 1], ref.ref_count)
    np.testing.assert_array_equal(p.last_access[1:n + 1], ref.last_accessed)
    for b in range(ref.num_used):
        keyed = isinstance(ref.key[b], tuple)
        assert p.cached[b + 1] == keyed
        if keyed:
            assert tuple(int(w) for w in p.key[:, b + 1]) == ref.key[b]
            assert p.num_hashed_tokens[b + 1] == ref.num_hashed_tokens[b]
    evictor = [b for b in range(1, n + 1) if b <= p.num_used and p.ref_count[b] == 0]
    assert sorted(evictor, key=lambda b: p.evict_seq[b]) == [b + 1 for b in ref.evictor.values()]
    # the ranking repeated evictions give, and lookups of every key
    probe = copy.deepcopy(ref)
    victims = [probe.evict() + 1 for _ in range(len(probe.evictor))]
    order = np.asarray(EVICT_ORDER(pool))
    assert list(order[:len(victims)]) == victims and (order[len(victims):] == SIZE).all()


def ref_allocate(ref, keys, tokens):
    return [ref.allocate(k, t) + 1 for k, t in zip(keys, tokens)]


def ref_promote(ref, blocks, keys):
    out = []
    for block, key in zip(blocks, keys):
        if ref.contains(key):
            ref.free(block - 1)
            out.append(ref.allocate(key) + 1)
        else:
            ref.update_key(key, block - 1)
            out.append(block)
    return out


KEY = st.tuples(st.integers(0, 4), st.integers(0, 1))
ENTRY = st.tuples(st.one_of(st.none(), KEY), st.sampled_from([2, 4, 6, 8]))


def run_ops(data, ref, pool, key_strategy=KEY) -> None:
    """Random allocate / free / promote / access steps on both pools, compared after each."""
    held: list[int] = []           # one entry per reference taken (jitted ids)
    now = 0.0
    for _ in range(data.draw(st.integers(1, 14))):
        op = data.draw(st.sampled_from(["allocate", "allocate", "free", "promote", "access"]))
        if op == "allocate" and ref.num_free:
            entries = data.draw(st.lists(st.tuples(st.one_of(st.none(), key_strategy),
                                                   st.sampled_from([2, 4, 6, 8])),
                                         min_size=1, max_size=min(K, ref.num_free)))
            keys, tokens = [k for k, _ in entries], [t for _, t in entries]
            want = ref_allocate(ref, keys, tokens)
            pool, got, ok = ALLOCATE(pool, key_array(keys), pad([k is not None for k in keys],
                                     False, bool), pad(tokens, 0, jnp.int32), jnp.int32(len(keys)))
            assert bool(ok) and list(np.asarray(got)[:len(keys)]) == want
            assert (np.asarray(got)[len(keys):] == SIZE).all()
            held += want
        elif op == "free" and held:
            picks = data.draw(st.lists(st.integers(0, len(held) - 1), max_size=K, unique=True))
            blocks = [held[i] for i in picks]
            for b in blocks:
                ref.free(b - 1)
            held = [b for i, b in enumerate(held) if i not in set(picks)]
            pool = FREE(pool, pad(blocks, SIZE, jnp.int32), pad([True] * len(blocks), False, bool))
        elif op == "promote":
            solo = sorted({b for b in held if ref.ref_count[b - 1] == 1})
            if not solo:
                continue
            blocks = data.draw(st.lists(st.sampled_from(solo), min_size=1, max_size=K, unique=True))
            keys = data.draw(st.lists(key_strategy, min_size=len(blocks), max_size=len(blocks)))
            if any(ref.ref_count[b - 1] != 1 for b in blocks):
                continue
            try:
                want = ref_promote(copy.deepcopy(ref), blocks, keys)
            except AssertionError:     # an earlier entry shared a later one's block
                continue
            want = ref_promote(ref, blocks, keys)
            pool, got = PROMOTE(pool, pad(blocks, SIZE, jnp.int32), key_array(keys),
                                pad([True] * len(blocks), False, bool))
            assert list(np.asarray(got)[:len(blocks)]) == want
            mapping = dict(zip(blocks, want))
            held = [mapping.get(b, b) for b in held]
        elif op == "access" and held:
            now += data.draw(st.sampled_from([0.0, 1.0]))
            blocks = data.draw(st.lists(st.sampled_from(sorted(set(held))), max_size=K, unique=True))
            for b in blocks:
                ref.access(b - 1, now)
            pool = ACCESS(pool, pad(blocks, SIZE, jnp.int32),
                          pad([True] * len(blocks), False, bool), jnp.float32(now))
        check_pool(pool)
        assert_same(ref, pool)
        probe = data.draw(st.lists(key_strategy, max_size=K))
        got = np.asarray(LOOKUP(pool, key_array(probe), pad([True] * len(probe), False, bool)))
        cached = {**ref.cached, **ref.evictor}
        assert [int(g) for g in got[:len(probe)]] == [cached[k] + 1 if k in cached else SIZE
                                                       for k in probe]


@settings(max_examples=60, deadline=None)
@given(st.data(), st.integers(1, SIZE - 1))
def test_pool__same_blocks_counts_keys_and_evictor_order_as_the_reference(data, num_active):
    run_ops(data, *make_pools(num_active))


def test_allocate__reports_no_free_block_and_pads_it():
    ref, pool = make_pools(2)
    pool, got, ok = ALLOCATE(pool, key_array([(1, 0)] * 3), pad([True, False, False], False, bool),
                             pad([2, 2, 2], 0, jnp.int32), jnp.int32(3))
    assert not bool(ok) and list(np.asarray(got)[:3]) == [1, 2, SIZE]
    check_pool(pool)


def test_evict_order__walks_in_entry_order_when_access_is_not_entry_order():
    """vLLM's walk, not an LRU: a block entered later but accessed earlier is only reached if
    no later-accessed block stands before it (the scan branch of evict_order)."""
    ref, pool = make_pools(4)
    keys = [(1, 0), (2, 0), (3, 0), (4, 0)]
    want = ref_allocate(ref, keys, [2, 4, 6, 8])
    pool, got, _ = ALLOCATE(pool, key_array(keys), pad([True] * 4, False, bool),
                            pad([2, 4, 6, 8], 0, jnp.int32), jnp.int32(4))
    times = [3.0, 1.0, 2.0, 1.0]
    for b, t in zip(want, times):
        ref.access(b - 1, t)
        pool = ACCESS(pool, pad([b], SIZE, jnp.int32), pad([True], False, bool), jnp.float32(t))
    for b in want:
        ref.free(b - 1)
    pool = FREE(pool, pad(want, SIZE, jnp.int32), pad([True] * 4, False, bool))
    assert_same(ref, pool)       # entry order 1..4; access 3, 1, 2, 1; tokens 2, 4, 6, 8
    # the first walk stops at block 3 (accessed after its choice, block 2): an LRU by
    # (access, most tokens) would give up block 4 first
    assert list(np.asarray(EVICT_ORDER(pool))[:4]) == [2, 4, 3, 1]


# ----------------------------------------------------------------------------- keys


def ref_key(seq: Sequence, index: int):
    return BlockManager.key(types.SimpleNamespace(block_size=BS), seq, index)


SEQ = st.integers(1, M * BS).flatmap(lambda n: st.tuples(
    st.lists(st.integers(0, 1), min_size=n, max_size=n), st.integers(0, M * BS - n)))


def keys_of(seqs, width=64):
    """Keys uint32[len(seqs), 2, M] and valid of (prompt, number of sampled outputs) pairs."""
    tokens = np.zeros((NUM_SEQS, M * BS), np.int32)
    lens, prompts = np.zeros(NUM_SEQS, np.int32), np.zeros(NUM_SEQS, np.int32)
    for i, (prompt, outputs) in enumerate(seqs):
        tokens[i, :len(prompt) + outputs] = list(prompt) + [SAMPLED_TOKEN] * outputs
        lens[i], prompts[i] = len(prompt) + outputs, len(prompt)
    keys, valid = (KEYS if width == 64 else TINY_KEYS)(*map(jnp.asarray, (tokens, lens, prompts)))
    return np.asarray(keys)[:len(seqs)], np.asarray(valid)[:len(seqs)]


@settings(max_examples=40, deadline=None)
@given(st.lists(SEQ, min_size=4, max_size=4))
def test_block_keys__equal_exactly_when_vllm_keys_are_equal(seqs):
    keys, valid = keys_of(seqs)
    refs = [Sequence(len(p), o, tuple(p)) for p, o in seqs]
    blocks = [(i, j) for i in range(4) for j in range(M) if valid[i, j]]
    for i, j in blocks:
        assert valid[i, j] == (j * BS < refs[i].num_tokens)
        for a, b in blocks:
            same = ref_key(refs[i], j) == ref_key(refs[a], b)
            assert same == bool((keys[i, :, j] == keys[a, :, b]).all()), (seqs, i, j, a, b)


def test_block_keys__prompt_end_marker_and_chaining():
    # (prompt 0 1 1, output 1) is not (prompt 0 1 1 1): vLLM keys the prompt/output split
    keys, _ = keys_of([([0, 1, 1], 1), ([0, 1, 1, 1], 0), ([0, 1, 1, 1], 2), ([1, 1, 1, 1], 2)])
    assert (keys[0, :, 0] == keys[1, :, 0]).all() and (keys[0, :, 1] != keys[1, :, 1]).any()
    # same block contents after a different first block: chained, so a different key
    assert (keys[2, :, 1] != keys[3, :, 1]).any() and (keys[2, :, 2] != keys[3, :, 2]).any()
    tiny, _ = keys_of([([0, 1, 1], 1)], width=TINY)
    assert tiny.max() < 2 ** TINY and (tiny[:, 1] == 0).all()


@settings(max_examples=25, deadline=None)
@given(st.data(), st.integers(1, SIZE - 1))
def test_pool__tiny_hash_collides_and_invariants_still_hold(data, num_active):
    """Keys of a 3-bit hash: distinct prefixes share keys (a wrong share, as vLLM's would
    at 64 bits with odds ~ n^2 / 2^65), and the pool stays the reference's and consistent."""
    seqs = [([i % 2, i // 2 % 2, i // 4 % 2, 1], 4) for i in range(8)]
    tiny, valid = keys_of(seqs, width=TINY)
    pool_keys = sorted({(int(tiny[i, 0, j]), int(tiny[i, 1, j]))
                        for i in range(8) for j in range(M) if valid[i, j]})
    assert len(pool_keys) <= 2 ** TINY < 8 * M            # pigeonhole: collisions happened
    run_ops(data, *make_pools(num_active), key_strategy=st.sampled_from(pool_keys))


def test_lookup__child_found_after_its_parent_block_was_evicted():
    """Keys hash content, not block ids: evicting a prompt's first block leaves its second
    findable, and re-allocating the prompt misses the first and hits the second."""
    keys, _ = keys_of([([0, 1, 0, 1], 0), ([1, 1, 1, 1], 0)])
    prompt = [(int(keys[0, 0, j]), int(keys[0, 1, j])) for j in range(2)]
    other = [(int(keys[1, 0, j]), int(keys[1, 1, j])) for j in range(2)]
    ref, pool = make_pools(2)
    want = ref_allocate(ref, prompt, [2, 4])
    pool, got, _ = ALLOCATE(pool, key_array(prompt), pad([True] * 2, False, bool),
                            pad([2, 4], 0, jnp.int32), jnp.int32(2))
    for b, t in zip(want, [1.0, 2.0]):         # the parent block is the older one
        ref.access(b - 1, t)
        pool = ACCESS(pool, pad([b], SIZE, jnp.int32), pad([True], False, bool), jnp.float32(t))
    for b in want:
        ref.free(b - 1)
    pool = FREE(pool, pad(want, SIZE, jnp.int32), pad([True] * 2, False, bool))
    want = ref_allocate(ref, other[:1], [6])                 # evicts the parent
    pool, got, _ = ALLOCATE(pool, key_array(other[:1]), pad([True], False, bool),
                            pad([6], 0, jnp.int32), jnp.int32(1))
    assert list(np.asarray(got)[:1]) == want == [1]
    assert_same(ref, pool)
    found = np.asarray(LOOKUP(pool, key_array(prompt), pad([True, True], False, bool)))
    assert list(found[:2]) == [SIZE, 2]
    ref.free(0)
    pool = FREE(pool, pad([1], SIZE, jnp.int32), pad([True], False, bool))
    want = ref_allocate(ref, prompt, [2, 4])
    pool, got, _ = ALLOCATE(pool, key_array(prompt), pad([True] * 2, False, bool),
                            pad([2, 4], 0, jnp.int32), jnp.int32(2))
    assert list(np.asarray(got)[:2]) == want == [1, 2]      # the parent misses, the child hits
    assert_same(ref, pool)
    check_pool(pool)
