"""Paged KV cache kernels and the attention implementations behind `paged_attention`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxsched.cache import kv_cache as kc
from jaxsched.cache.attention import (
    AttentionMetadata,
    StepKV,
    bucket,
    make_metadata,
    paged_attention,
    paged_decode_attention,
    step_visibility,
)

NUM_LAYERS, NUM_BLOCKS, NUM_HOST_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 2, 16, 8, 4, 2, 8
MAX_PAIRS = 6


def make_cache(seed: int = 0) -> kc.KVCache:
    """A cache whose device and host blocks all hold distinct random values (null block kept 0)."""
    cache = kc.init_kv_cache(NUM_LAYERS, NUM_BLOCKS, NUM_HOST_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    rng = np.random.default_rng(seed)
    k, v = (rng.standard_normal(cache.k.shape).astype(np.float32) for _ in range(2))
    k[kc.NULL_BLOCK] = v[kc.NULL_BLOCK] = 0
    host_k, host_v = (rng.standard_normal(cache.host_k.shape).astype(np.float32) for _ in range(2))
    host = cache.host_k.sharding
    return cache.replace(k=jnp.asarray(k), v=jnp.asarray(v),
                         host_k=jax.device_put(host_k, host), host_v=jax.device_put(host_v, host))


def as_numpy(cache: kc.KVCache) -> dict[str, np.ndarray]:
    return {name: np.array(getattr(cache, name)) for name in ("k", "v", "host_k", "host_v")}


def make_pairs(pairs: list[tuple[int, int]]) -> jax.Array:
    padded = pairs + [(kc.PAD_ID, kc.PAD_ID)] * (MAX_PAIRS - len(pairs))
    return jnp.asarray(padded, jnp.int32)


def test_init__host_pool_in_host_memory_when_backend_has_it():
    cache = kc.init_kv_cache(NUM_LAYERS, NUM_BLOCKS, NUM_HOST_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    assert cache.host_memory_kind == ("pinned_host" if "pinned_host" in kinds else None)
    if cache.host_memory_kind:
        assert cache.host_k.sharding.memory_kind == "pinned_host"
    assert cache.k.shape == (NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    assert cache.host_k.shape == (NUM_HOST_BLOCKS, NUM_LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)


def test_write__scatters_slots_and_drops_padding():
    cache = kc.init_kv_cache(NUM_LAYERS, NUM_BLOCKS, NUM_HOST_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    slots = jnp.asarray([5 * BLOCK_SIZE + 1, 9 * BLOCK_SIZE + 3, kc.PAD_ID], jnp.int32)
    k = jnp.arange(3 * KV_HEADS * HEAD_DIM, dtype=jnp.float32).reshape(3, KV_HEADS, HEAD_DIM) + 1
    new = kc.write(cache, 1, k, -k, slots)
    assert cache.k.is_deleted()  # donated
    got = np.asarray(new.k)
    np.testing.assert_array_equal(got[5, 1, 1], k[0])
    np.testing.assert_array_equal(got[9, 1, 3], k[1])
    np.testing.assert_array_equal(np.asarray(new.v)[9, 1, 3], -k[1])
    assert np.count_nonzero(got) == 2 * KV_HEADS * HEAD_DIM  # padding token wrote nothing
    assert np.count_nonzero(got[:, 0]) == 0  # other layer untouched


@pytest.mark.parametrize("kernel", [kc.copy_blocks, kc.swap_out, kc.swap_in])
def test_kernels__donate_the_cache(kernel):
    cache = make_cache()
    new = kernel(cache, make_pairs([(1, 2)]), jnp.int32(1))
    assert cache.k.is_deleted() and cache.host_k.is_deleted()
    assert not new.k.is_deleted()
    assert new.host_k.sharding.memory_kind == make_cache().host_k.sharding.memory_kind


pair_lists = st.lists(st.tuples(st.integers(1, NUM_BLOCKS - 1), st.integers(1, NUM_BLOCKS - 1)),
                      max_size=MAX_PAIRS, unique_by=lambda p: p[1])


@settings(max_examples=25, deadline=None)
@given(pairs=pair_lists, extra=st.integers(0, 2))
def test_copy_blocks__matches_numpy_and_ignores_rows_past_count(pairs, extra):
    cache = make_cache()
    before = as_numpy(cache)
    # Rows past `count` hold real-looking ids, not PAD_ID: they must still be ignored.
    junk = [(1, 2)] * min(extra, MAX_PAIRS - len(pairs))
    after = as_numpy(kc.copy_blocks(cache, make_pairs(pairs + junk), jnp.int32(len(pairs))))
    for name in ("k", "v"):
        want = before[name].copy()
        for src, dst in pairs:
            want[dst] = before[name][src]
        np.testing.assert_array_equal(after[name], want)
    np.testing.assert_array_equal(after["host_k"], before["host_k"])


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_swap__out_then_in_to_other_blocks_is_bitwise_exact(data):
    n = data.draw(st.integers(0, MAX_PAIRS))
    dev_src = data.draw(st.permutations(range(1, NUM_BLOCKS)))[:n]
    host = data.draw(st.permutations(range(NUM_HOST_BLOCKS)))[:n]
    dev_dst = data.draw(st.permutations(range(1, NUM_BLOCKS)))[:n]
    cache = make_cache()
    before = as_numpy(cache)
    cache = kc.swap_out(cache, make_pairs(list(zip(dev_src, host))), jnp.int32(n))
    mid = as_numpy(cache)
    cache = kc.swap_in(cache, make_pairs(list(zip(host, dev_dst))), jnp.int32(n))
    after = as_numpy(cache)
    untouched_host = sorted(set(range(NUM_HOST_BLOCKS)) - set(host))
    for name in ("k", "v"):
        np.testing.assert_array_equal(mid[name], before[name])  # swap_out leaves the device pool
        np.testing.assert_array_equal(mid["host_" + name][untouched_host], before["host_" + name][untouched_host])
        for src, h, dst in zip(dev_src, host, dev_dst):
            np.testing.assert_array_equal(mid["host_" + name][h], before[name][src])
            np.testing.assert_array_equal(after[name][dst], before[name][src])
        untouched_dev = sorted(set(range(NUM_BLOCKS)) - set(dev_dst))
        np.testing.assert_array_equal(after[name][untouched_dev], before[name][untouched_dev])


@pytest.mark.parametrize("kernel, pairs", [(kc.swap_out, [(3, 1), (5, 7)]), (kc.swap_in, [(1, 3), (7, 5)])])
def test_swap__padding_rows_are_harmless_even_when_counted(kernel, pairs):
    before = as_numpy(make_cache())
    after = as_numpy(kernel(make_cache(), make_pairs(pairs), jnp.int32(MAX_PAIRS)))  # count overstated
    on_device = kernel is kc.swap_in
    src_name, dst_name = ("host_k", "k") if on_device else ("k", "host_k")
    num_dst = NUM_BLOCKS if on_device else NUM_HOST_BLOCKS
    untouched = sorted(set(range(num_dst)) - {dst for _, dst in pairs})
    np.testing.assert_array_equal(after[dst_name][untouched], before[dst_name][untouched])
    for src, dst in pairs:
        np.testing.assert_array_equal(after[dst_name][dst], before[src_name][src])


def test_bucket__powers_of_two_capped():
    assert [bucket(n, 64) for n in (0, 1, 8, 9, 33, 64)] == [8, 8, 8, 16, 64, 64]
    assert bucket(90, 96) == 96
    with pytest.raises(ValueError):
        bucket(65, 64)


# ----------------------------------------------------------------------------- attention


def naive_attention(q, k_pool, v_pool, md: AttentionMetadata) -> np.ndarray:
    """Loop over tokens in numpy, float64: the semantics in their plainest form."""
    q, k_pool, v_pool = (np.asarray(x, np.float64) for x in (q, k_pool, v_pool))
    t, h, d = q.shape
    group = h // k_pool.shape[2]
    out = np.zeros_like(q)
    for i in range(t):
        table, pos = np.asarray(md.block_tables)[int(md.seq_ids[i])], int(md.positions[i])
        keys = k_pool[table].reshape(-1, k_pool.shape[2], d)[: pos + 1]
        values = v_pool[table].reshape(-1, k_pool.shape[2], d)[: pos + 1]
        for head in range(h):
            s = keys[:, head // group] @ q[i, head] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[i, head] = p @ values[:, head // group] / p.sum()
    return out


@pytest.mark.parametrize("impl", ["reference", "chunked"])
@pytest.mark.parametrize("num_heads", [2, 6])
def test_paged_attention__matches_naive_on_ragged_batch(impl, num_heads):
    rng = np.random.default_rng(1)
    k_pool, v_pool = (jnp.asarray(rng.standard_normal((NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)), jnp.float32)
                      for _ in range(2))
    tables = [[7, 2, 12], [4], [9, 15, 1, 3]]  # scattered, non-contiguous
    md = make_metadata(tables, [0, 2, 9], [10, 1, 4], BLOCK_SIZE, 4, num_tokens=16, num_seqs=4)
    q = jnp.asarray(rng.standard_normal((16, num_heads, HEAD_DIM)), jnp.float32)
    out = paged_attention(q, k_pool, v_pool, md, impl=impl)
    valid = int(md.num_valid)
    np.testing.assert_allclose(out[:valid], naive_attention(q, k_pool, v_pool, md)[:valid], atol=1e-5)
    assert np.isfinite(np.asarray(out)).all()  # padding rows too


def test_paged_decode_attention__equals_paged_attention():
    rng = np.random.default_rng(2)
    k_pool, v_pool = (jnp.asarray(rng.standard_normal((NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)), jnp.float32)
                      for _ in range(2))
    tables = [[3, 8], [11, 5, 6], [2]]
    lens = [7, 10, 1]
    md = make_metadata(tables, [n - 1 for n in lens], [1, 1, 1], BLOCK_SIZE, 4, num_tokens=3, num_seqs=3)
    q = jnp.asarray(rng.standard_normal((3, 4, HEAD_DIM)), jnp.float32)
    got = paged_decode_attention(q, k_pool, v_pool, md.block_tables, md.context_lens)
    np.testing.assert_allclose(got, paged_attention(q, k_pool, v_pool, md, impl="reference"), atol=1e-5)


def _multi_layer_pools(rng):
    shape = (NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    return k, v


@pytest.mark.parametrize("impl,num_tokens", [("reference", 32), ("chunked", 32), ("chunked", 80)])
def test_paged_attention__new_kv_beside_pools_equals_write_then_read(impl, num_tokens):
    """The step's K/V given apart (pools unwritten) attend exactly like written-then-read ones,
    through the whole multi-layer pools and a layer index. Rows 3 and 4 share block 13 (a
    forked group's prompt) that row 3 writes this step while row 4 decodes past it: row 4
    must see row 3's new keys through its own table."""
    rng = np.random.default_rng(3)
    k_all, v_all = _multi_layer_pools(rng)
    tables = [[7, 2, 12], [4], [9, 15, 1, 3], [13, 6], [13, 10]]
    num_computed, num_new = [0, 2, 9, 1, 5], [10, 1, 4, 3, 1]   # row 3 writes positions 1-3 of block 13
    md = make_metadata(tables, num_computed, num_new, BLOCK_SIZE, 4, num_tokens=num_tokens, num_seqs=8)
    t = md.positions.shape[0]
    k_new, v_new = (jnp.asarray(rng.standard_normal((t, KV_HEADS, HEAD_DIM)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((t, 6, HEAD_DIM)), jnp.float32)
    layer = 1
    written = kc.write_kv(kc.KVCache(k=jnp.asarray(k_all), v=jnp.asarray(v_all), host_k=jnp.zeros(1), host_v=jnp.zeros(1)),
                          layer, k_new, v_new, md.slot_mapping)
    want = paged_attention(q, written.k[:, layer], written.v[:, layer], md, impl="reference")
    visible = step_visibility(md, BLOCK_SIZE, NUM_BLOCKS)
    got = paged_attention(q, jnp.asarray(k_all), jnp.asarray(v_all), md, impl=impl, layer=layer,
                          new=StepKV(k_new, v_new, visible))
    valid = int(md.num_valid)
    np.testing.assert_allclose(got[:valid], want[:valid], atol=1e-5)
    np.testing.assert_allclose(want[:valid], naive_attention(q, written.k[:, layer], written.v[:, layer], md)[:valid],
                               atol=1e-5)
    assert np.isfinite(np.asarray(got)).all()  # padding rows too


def test_step_visibility__masks_own_slots_and_shared_blocks():
    tables = [[5, 6], [5, 7]]   # rows share block 5
    md = make_metadata(tables, [2, 4], [3, 1], BLOCK_SIZE, 2, num_tokens=8, num_seqs=2)
    vis = step_visibility(md, BLOCK_SIZE, NUM_BLOCKS)
    cached, new = np.asarray(vis.cached), np.asarray(vis.new)
    # token 0 (row 0, position 2): cached keys 0, 1; position 2 is written this step
    assert cached[0, :4].tolist() == [True, True, False, False]
    # token 3 (row 1, position 4): cached 0, 1 of block 5; 2, 3 are row 0's new keys, seen as new
    assert cached[3, :5].tolist() == [True, True, False, False, False]
    assert new[3, :4].tolist() == [True, True, False, True]   # row 0's positions 2, 3; its own 4 (not row 0's 4)
    assert not new[:, 4:].any()  # padding keys are never seen


def test_write_layers__scatters_every_layer_and_drops_padding():
    cache = kc.init_kv_cache(NUM_LAYERS, NUM_BLOCKS, NUM_HOST_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    slots = jnp.asarray([5 * BLOCK_SIZE + 1, kc.PAD_ID, 9 * BLOCK_SIZE + 3], jnp.int32)
    k = jnp.arange(NUM_LAYERS * 3 * KV_HEADS * HEAD_DIM, dtype=jnp.float32).reshape(NUM_LAYERS, 3, KV_HEADS, HEAD_DIM) + 1
    new = jax.jit(kc.write_layers, donate_argnums=0)(cache, k, -k, slots)
    got_k, got_v = np.asarray(new.k), np.asarray(new.v)
    for layer in range(NUM_LAYERS):
        np.testing.assert_array_equal(got_k[5, layer, 1], k[layer, 0])
        np.testing.assert_array_equal(got_v[9, layer, 3], -k[layer, 2])
    assert np.count_nonzero(got_k) == 2 * NUM_LAYERS * KV_HEADS * HEAD_DIM  # padding dropped
