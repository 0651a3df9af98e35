"""The block pool's primitives against plain numpy, on random inputs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jaxsched.core import batching
from jaxsched.core import block_pool as bp


@settings(max_examples=60, deadline=None)
# Shapes from a few sizes (edges and a long one): each new shape compiles the ops again.
@given(hnp.arrays(np.int32, st.tuples(st.sampled_from([1, 3]), st.sampled_from([1, 2, 37, 300])),
                  elements=st.integers(-1000, 1000)), st.booleans())
def test_cumsum__equals_numpy_with_and_without_the_float_bound(x, bounded):
    bound = int(np.abs(x).sum()) + 1 if bounded else None
    np.testing.assert_array_equal(bp.cumsum(jnp.asarray(x), axis=1, bound=bound), np.cumsum(x, axis=1))
    np.testing.assert_array_equal(bp.exclusive_cumsum(jnp.asarray(x), axis=1, bound=bound),
                                  np.cumsum(x, axis=1) - x)


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.int32, st.sampled_from([2, 3, 64, 200]), elements=st.integers(0, 3)), st.integers(0, 250))
def test_free_list__lowest_free_active_blocks_first_padded_out_of_range(ref, active):
    ref[0] = 0                                   # the null block is never free anyway
    got = np.asarray(bp.free_list(jnp.asarray(ref), jnp.int32(active)))
    ids = np.arange(len(ref))
    free = ids[(ref == 0) & (ids >= 1) & (ids <= active)]
    assert int(bp.num_free(jnp.asarray(ref), jnp.int32(active))) == len(free)
    np.testing.assert_array_equal(got[:len(free)], free)
    assert (got[len(free):] == len(ref)).all()


def test_mask_rank_and_take_ranked():
    rng = np.random.default_rng(0)
    mask = rng.random((4, 3, 5)) < 0.4
    rank = np.asarray(bp.mask_rank(jnp.asarray(mask)))
    np.testing.assert_array_equal(rank.reshape(-1)[mask.reshape(-1)], np.arange(mask.sum()))
    blocks = jnp.arange(100, 100 + mask.size, dtype=jnp.int32)
    taken = np.asarray(bp.take_ranked(blocks, jnp.asarray(rank), jnp.asarray(mask)))
    assert (taken[~mask] == 0).all() and (taken[mask] == 100 + np.arange(mask.sum())).all()


def test_first_holder__lowest_sequence_with_the_same_block_at_that_position():
    rng = np.random.default_rng(1)
    g, s, m = 6, 4, 5
    table = rng.integers(1, 4, (g, s, m)).astype(np.int32)
    valid = rng.random((g, s, m)) < 0.8
    holder, is_first = map(np.asarray, bp.first_holder(jnp.asarray(table), jnp.asarray(valid)))
    for gi in range(g):
        for si in range(s):
            for mi in range(m):
                same = [o for o in range(si) if valid[gi, o, mi] and valid[gi, si, mi]
                        and table[gi, o, mi] == table[gi, si, mi]]
                assert holder[gi, si, mi] == (same[0] if same else si)
    assert (is_first == (holder == np.arange(s)[None, :, None])).all()


def test_add_refs_and_write_pairs__masked_entries_only_and_padding_dropped():
    ref = jnp.zeros(8, jnp.int32)
    table = jnp.asarray([[1, 2, 2], [3, 0, 7]], jnp.int32)
    mask = jnp.asarray([[True, True, False], [True, False, True]])
    np.testing.assert_array_equal(bp.add_refs(ref, table, mask, 2), [0, 2, 2, 2, 0, 0, 0, 2])
    pairs = jnp.full((2, 4, 2), 99, jnp.int32)
    out, count = bp.write_pairs(pairs, 1, table, table + 10, mask)
    assert int(count) == 4
    np.testing.assert_array_equal(out[1], [[1, 11], [2, 12], [3, 13], [7, 17]])
    assert (np.asarray(out[0]) == 99).all()
    # After `count` pairs already in the row: the new ones follow them, the count is the row's.
    out, count = bp.write_pairs(pairs, 1, table[1:], table[1:] + 10, mask[1:], count=2)
    assert int(count) == 4
    np.testing.assert_array_equal(out[1], [[99, 99], [99, 99], [3, 13], [7, 17]])


# Jitted once per shape: eagerly, every call would trace and compile `on_rows`' loop anew.
_add_refs = jax.jit(lambda ref, table, mask, delta, groups: bp.add_refs(ref, table, mask, delta,
                                                                        groups=groups))
_write_pairs = jax.jit(lambda pairs, table, mask, groups: bp.write_pairs(
    pairs, 1, table, table + 100, mask, groups=groups))


@jax.jit
def _bump_rows(groups, table, mask):
    """A rewrite of the marked rows (put_rows puts back the rows taken into the carry)."""
    def bump(at, out, rows, mask):
        return bp.put_rows(out, at, jnp.where(mask, rows + 1, rows))
    return bp.on_rows(groups, bump, table, table, mask)


@jax.jit
def _add_refs_batched(ref, table, mask, delta, groups):
    def one(ref, table, mask, delta, groups):
        with batching.runs_axis("runs"):
            return bp.add_refs(ref, table, mask, delta, groups=groups)
    return jax.vmap(one, axis_name="runs")(ref, table, mask, delta, groups)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([0, 1, 3, bp.FEW_GROUPS, bp.FEW_GROUPS + 1, 20]),
       st.booleans())
def test_add_refs_write_pairs_put_rows__rows_of_few_groups_equal_the_whole_table(seed, marked, per_entry_delta):
    """The marked groups' rows taken FEW_GROUPS at a time (none, one trip or three) give the
    plain count, the pairs in flat order and the rewritten rows; so do runs of a vmapped
    batch whose marked counts need different numbers of trips (the batch takes the most
    any run needs)."""
    rng = np.random.default_rng(seed)
    g, s, m, d = 24, 2, 5, 40

    def one(r, k):
        table = r.integers(0, d, (g, s, m)).astype(np.int32)
        groups = np.zeros(g, bool)
        groups[r.choice(g, k, replace=False)] = True
        mask = (r.random((g, s, m)) < 0.6) & groups[:, None, None]
        delta = r.integers(-2, 3, (g, s, m)).astype(np.int32) if per_entry_delta else np.int32(-1)
        ref = r.integers(0, 5, d).astype(np.int32)
        expect = ref.copy()
        np.add.at(expect, table[mask], np.broadcast_to(delta, mask.shape)[mask])
        return ref, table, mask, delta, groups, expect

    ref, table, mask, delta, groups, expect = one(rng, marked)
    np.testing.assert_array_equal(_add_refs(ref, table, mask, delta, groups), expect)
    # write_pairs on the same rows: the masked (table, table + 100) pairs in flat order.
    out, count = _write_pairs(jnp.full((2, g * s * m, 2), 999, jnp.int32), table, mask, groups)
    assert int(count) == mask.sum()
    np.testing.assert_array_equal(out[1, :mask.sum()], np.stack([table[mask], table[mask] + 100], -1))
    assert (np.asarray(out[1, mask.sum():]) == 999).all() and (np.asarray(out[0]) == 999).all()
    np.testing.assert_array_equal(_bump_rows(groups, table, mask), np.where(mask, table + 1, table))
    runs = [one(rng, k) for k in (marked, 2, bp.FEW_GROUPS + 3 if marked % 2 else 1)]
    stack = lambda i: np.stack([np.broadcast_to(r[i], runs[0][i].shape) for r in runs])
    got = _add_refs_batched(*(stack(i) for i in range(5)))
    np.testing.assert_array_equal(got, np.stack([r[5] for r in runs]))


@pytest.mark.parametrize("default", [7, -3])
def test_first_true(default):
    assert int(bp.first_true(jnp.asarray([False, True, True]), default)) == 1
    assert int(bp.first_true(jnp.zeros(4, bool), default)) == default
