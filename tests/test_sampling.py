"""Sampling: greedy, filters against a NumPy reference, empirical distributions, keys, retraces."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxsched.engine.sampling import SAMPLING_EPS, filter_logits, sample, token_key

SAMPLE = jax.jit(sample, static_argnames="want_logprobs")
FILTER = jax.jit(filter_logits)
R, V = 4, 16  # the one shape most tests share, so they share one compile


def make_params(rows: int, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    """(temperature, top_k, top_p, min_p) arrays of `rows` rows; scalars broadcast."""
    return (jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (rows,)),
            jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (rows,)),
            jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (rows,)),
            jnp.broadcast_to(jnp.asarray(min_p, jnp.float32), (rows,)))


def make_keys(rows: int, seed=0, seq_index=0, first_position=0):
    """Row i gets the key of position first_position + i of one request."""
    base = jax.random.PRNGKey(seed)
    positions = jnp.arange(rows) + first_position
    return jax.vmap(token_key, in_axes=(None, None, 0))(base, seq_index, positions)


def make_logits(rows: int, vocab: int, seed=0, scale=2.0):
    return jax.random.normal(jax.random.PRNGKey(seed), (rows, vocab)) * scale


def reference_probs(row, temperature, top_k=-1, top_p=1.0, min_p=0.0):
    """Plain NumPy (float64) of the filtered, renormalised distribution of one row."""
    x = np.asarray(row, np.float64) / temperature
    keep = np.ones(x.shape, bool)
    if 0 < top_k < x.size:
        keep &= x >= np.sort(x)[::-1][top_k - 1]
    if top_p < 1:
        probs = np.where(keep, np.exp(x - x.max()), 0.0)
        probs /= probs.sum()
        order = np.argsort(-x, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        last_value = x[order][before < top_p][-1]
        keep &= x >= last_value  # ties with the last kept value stay
    probs = np.where(keep, np.exp(x - x.max()), 0.0)
    keep &= probs >= min_p * probs.max()
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


def test_sample__greedy_is_argmax_independent_of_key():
    logits = make_logits(R, V)
    logits = logits.at[0, 3].set(9.0).at[0, 11].set(9.0)  # a tie: lowest id wins
    for seed in range(3):
        tokens, _ = SAMPLE(logits, *make_params(R, temperature=0.0), make_keys(R, seed))
        np.testing.assert_array_equal(tokens, np.argmax(np.asarray(logits), axis=-1))
    assert int(tokens[0]) == 3


def test_sample__temperature_below_eps_is_greedy():
    logits = make_logits(R, V, scale=0.1)
    tokens, _ = SAMPLE(logits, *make_params(R, temperature=SAMPLING_EPS / 10), make_keys(R))
    np.testing.assert_array_equal(tokens, np.argmax(np.asarray(logits), axis=-1))


def test_sample__same_key_same_token_other_positions_differ():
    vocab = 64
    logits = jnp.zeros((vocab, vocab))  # uniform: every position is a fresh draw
    a, _ = SAMPLE(logits, *make_params(vocab), make_keys(vocab))
    b, _ = SAMPLE(logits, *make_params(vocab), make_keys(vocab))
    np.testing.assert_array_equal(a, b)
    assert len(set(np.asarray(a).tolist())) > vocab // 3  # ~40 distinct expected of 64 draws
    shifted, _ = SAMPLE(logits, *make_params(vocab), make_keys(vocab, first_position=1))
    np.testing.assert_array_equal(shifted[:-1], a[1:])  # the token follows its position's key


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_sample__degenerate_filters_are_greedy(filters):
    logits = make_logits(R, V)  # continuous values: no ties at the max
    for seed in range(5):
        tokens, _ = SAMPLE(logits, *make_params(R, temperature=1.5, **filters), make_keys(R, seed))
        np.testing.assert_array_equal(tokens, np.argmax(np.asarray(logits), axis=-1))


def test_filter__top_k_keeps_ties_at_the_boundary():
    row = jnp.asarray([[5.0, 3.0, 4.0, 3.0, 1.0, 0.0, 3.0, -1.0] * 2])
    kept = FILTER(row, jnp.asarray([5]), jnp.asarray([1.0]), jnp.asarray([0.0]))  # 5,5,4,4,3 | 3..
    np.testing.assert_array_equal(np.isfinite(kept[0]), np.asarray(row[0]) >= 3.0)


def test_filter__top_p_support_is_the_nucleus():
    # probs 0.5, 0.25, 0.125, ... by value: the nucleus of p is the shortest prefix reaching p.
    logits = jnp.log(jnp.asarray([0.05, 0.4, 0.1, 0.3, 0.15, 1e-9]))[None]
    logits = jnp.pad(logits, ((0, R - 1), (0, V - 6)), constant_values=-30.0)
    for p, nucleus in [(0.35, {1}), (0.41, {1, 3}), (0.75, {1, 3, 4}),
                       (0.9, {1, 3, 4, 2}), (0.99, {1, 3, 4, 2, 0})]:
        kept = FILTER(logits, *make_params(R, top_p=p)[1:3], jnp.zeros(R))
        assert set(np.flatnonzero(np.isfinite(kept[0]))) == nucleus, p


def test_filter__top_p_applies_to_the_renormalised_top_k():
    logits = jnp.log(jnp.asarray([0.4, 0.3, 0.2, 0.1]))[None].repeat(R, 0)
    logits = jnp.pad(logits, ((0, 0), (0, V - 4)), constant_values=-30.0)
    # top-2 leaves 0.4/0.7 = 0.571 and 0.429: p = 0.55 needs only the first (of the original
    # distribution it would need two), p = 0.6 needs both.
    for p, support in [(0.55, {0}), (0.6, {0, 1})]:
        kept = FILTER(logits, *make_params(R, top_k=2, top_p=p)[1:3], jnp.zeros(R))
        assert set(np.flatnonzero(np.isfinite(kept[0]))) == support


def test_filter__disabled_filters_keep_tokens_of_negligible_mass():
    # exp(-30) is below float32's resolution of the total mass, so a top-p of 1.0 evaluated
    # as "mass >= 1.0 * total" would drop these tokens; disabled must mean disabled.
    logits = jnp.full((R, V), -30.0).at[:, 0].set(0.0)
    top_k = jnp.asarray([-1, 2, -1, -1])  # row 1 makes the batch run the threshold search
    kept = FILTER(logits, top_k, jnp.ones(R), jnp.zeros(R))
    assert np.isfinite(np.asarray(kept)[[0, 2, 3]]).all()


def test_sample__top_k_restricts_support():
    rows = 512
    logits = make_logits(1, V, scale=0.5).repeat(rows, 0)  # flat enough to reach every token
    tokens, _ = SAMPLE(logits, *make_params(rows, top_k=4), make_keys(rows))
    top4 = set(np.argsort(-np.asarray(logits[0]))[:4].tolist())
    assert set(np.asarray(tokens).tolist()) == top4


@pytest.mark.parametrize("temperature, filters", [
    (1.0, {}), (0.5, dict(top_k=3)), (1.0, dict(top_p=0.7)), (2.0, dict(min_p=0.3)),
    (1.3, dict(top_k=6, top_p=0.9, min_p=0.05)),
])
def test_sample__empirical_distribution_matches_filtered_softmax(temperature, filters):
    rows, vocab = 20_000, 8
    row = jnp.asarray([1.0, 0.5, 0.0, -0.3, 0.8, -1.0, 0.2, 0.4])
    tokens, _ = SAMPLE(row[None].repeat(rows, 0), *make_params(rows, temperature, **filters),
                       make_keys(rows, seed=7))
    counts = np.bincount(np.asarray(tokens), minlength=vocab)
    expected = reference_probs(row, temperature, **filters) * rows
    assert np.all(counts[expected == 0] == 0)  # nothing outside the filtered support
    support = expected > 0
    chi2 = np.sum((counts[support] - expected[support]) ** 2 / expected[support])
    # chi-square with <= 7 degrees of freedom: P(chi2 > 30) < 1e-4; keys are fixed, so no flakes.
    assert chi2 < 30.0, (chi2, counts, expected)


def test_sample__logprobs_are_raw_log_softmax_at_the_token():
    logits = make_logits(R, V)
    params = make_params(R, temperature=jnp.asarray([0.0, 0.7, 1.0, 2.0]),
                         top_k=jnp.asarray([-1, 3, -1, 5]), top_p=jnp.asarray([1.0, 1.0, 0.5, 0.9]))
    tokens, logprobs = SAMPLE(logits, *params, make_keys(R))
    expected = jax.nn.log_softmax(logits, axis=-1)[jnp.arange(R), tokens]
    np.testing.assert_allclose(logprobs, expected, rtol=1e-6, atol=1e-6)
    assert logprobs.dtype == jnp.float32
    same_tokens, zeros = SAMPLE(logits, *params, make_keys(R), want_logprobs=False)
    np.testing.assert_array_equal(same_tokens, tokens)
    np.testing.assert_array_equal(zeros, 0.0)


def test_sample__row_ignores_its_neighbours_parameters():
    logits = make_logits(R, V)
    keys = make_keys(R, seed=3)
    plain, _ = SAMPLE(logits, *make_params(R, temperature=1.0), keys)
    # Rows 1.. now need the threshold search, which row 0 does not: same token for row 0.
    mixed, _ = SAMPLE(logits, *make_params(R, temperature=1.0, top_k=jnp.asarray([-1, 2, 3, 4]),
                                           top_p=jnp.asarray([1.0, 0.5, 1.0, 0.8])), keys)
    assert int(plain[0]) == int(mixed[0])
    greedy, _ = SAMPLE(logits, *make_params(R, temperature=0.0), keys)
    half, _ = SAMPLE(logits, *make_params(R, temperature=jnp.asarray([0.0, 1.0, 0.0, 1.0])), keys)
    np.testing.assert_array_equal(half[::2], greedy[::2])
    np.testing.assert_array_equal(half[1::2], plain[1::2])


def test_sample__one_trace_across_parameter_values():
    traced = jax.jit(chex.assert_max_traces(sample, n=1), static_argnames="want_logprobs")
    logits = make_logits(R, V)
    for temperature, top_k, top_p, min_p in [(0.0, -1, 1.0, 0.0), (1.0, -1, 1.0, 0.0),
                                             (0.7, 5, 1.0, 0.0), (1.2, -1, 0.8, 0.0),
                                             (1.0, 0, 1.0, 0.3), (0.0, 3, 0.5, 0.1)]:
        traced(logits, *make_params(R, temperature, top_k, top_p, min_p), make_keys(R))
    chex.clear_trace_counter()


def test_keys__token_key_is_nested_fold_in():
    base = jax.random.PRNGKey(11)
    expected = jax.random.fold_in(jax.random.fold_in(base, 2), 37)
    np.testing.assert_array_equal(token_key(base, 2, 37), expected)


def test_sample__a_token_depends_on_its_key_not_its_row_or_neighbours():
    """A sequence recomputed after a preemption lands in another batch row, beside other
    rows: with the same base key, sequence index and position it samples the same token."""
    base = jnp.stack([jax.random.PRNGKey(s) for s in (3, 4, 5, 6)]).astype(jnp.uint32)
    seq_index = jnp.asarray([0, 1, 0, 0], jnp.int32)
    position = jnp.asarray([20, 31, 7, 0], jnp.int32)
    keys = jax.vmap(token_key)(base, seq_index, position)
    logits = make_logits(R, V, seed=5)
    temperature = jnp.asarray([1.0, 0.8, 1.2, 1.0], jnp.float32)
    top_p = jnp.asarray([0.9, 1.0, 0.95, 1.0], jnp.float32)
    top_k, min_p = jnp.full(R, -1, jnp.int32), jnp.asarray([0.0, 0.1, 0.0, 0.0], jnp.float32)
    first, lp1 = SAMPLE(logits, temperature, top_k, top_p, min_p, keys)
    perm = jnp.asarray([2, 0, 3, 1])
    again, lp2 = SAMPLE(logits[perm], temperature[perm], top_k[perm], top_p[perm], min_p[perm],
                        jax.vmap(token_key)(base[perm], seq_index[perm], position[perm]))
    np.testing.assert_array_equal(again, first[perm])
    np.testing.assert_allclose(lp2, lp1[perm])


filter_rows = st.tuples(
    st.lists(st.integers(-6, 6), min_size=V, max_size=V),  # small integers: plenty of ties
    st.sampled_from([0.25, 0.5, 1.0, 3.0]),
    st.integers(-1, V + 1),
    st.floats(0.05, 1.0),
    st.floats(0.0, 1.0),
)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(filter_rows, min_size=R, max_size=R), seed=st.integers(0, 2**32 - 1))
def test_sample__property_token_within_filtered_set(rows, seed):
    logits = jnp.asarray([r[0] for r in rows], jnp.float32)
    temperature, top_k, top_p, min_p = (jnp.asarray([r[i] for r in rows]) for i in range(1, 5))
    params = make_params(R, temperature, top_k, top_p, min_p)
    kept = np.isfinite(np.asarray(FILTER(logits / params[0][:, None], *params[1:])))
    tokens, _ = SAMPLE(logits, *params, make_keys(R, seed=seed))
    for i, (row, t, k, p, m) in enumerate(rows):
        # The reference at p +- 1e-4 and min_p -+ 1e-4 brackets the kept set against rounding.
        narrow = reference_probs(row, t, k, max(p - 1e-4, 1e-6), min(m + 1e-4, 1.0)) > 0
        wide = reference_probs(row, t, k, min(p + 1e-4, 1.0), max(m - 1e-4, 0.0)) > 0
        assert np.all(kept[i] <= wide) and np.all(narrow <= kept[i]), (i, row, t, k, p, m)
        assert kept[i, int(tokens[i])]
        assert kept[i, int(np.argmax(row))]  # the top token always survives


@settings(max_examples=40, deadline=None)
@given(row=st.lists(st.floats(-20, 20, width=32, allow_subnormal=False), min_size=V, max_size=V),
       top_k=st.integers(1, V), top_p=st.floats(1e-3, 1.0))
def test_filter__property_top_k_and_top_p_sizes(row, top_k, top_p):
    logits = jnp.asarray([row] * R, jnp.float32)
    kept = np.isfinite(np.asarray(FILTER(logits, *make_params(R, top_k=top_k, top_p=top_p)[1:3],
                                         jnp.zeros(R))))[0]
    x = np.asarray(row, np.float32)
    assert kept.any()
    if not kept.all():  # a threshold on values: every kept value above every dropped one
        assert x[kept].min() > x[~kept].max()
    # top-k alone keeps the k largest plus ties with the k-th; top-p only narrows that set.
    ties_at_threshold = np.sum(x == x[kept].min())
    assert kept.sum() - ties_at_threshold < top_k
    if top_p == 1.0:
        assert kept.sum() >= top_k
