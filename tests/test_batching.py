"""core.batching: a batch of runs decides its skips once, or takes none; every run gets what it
would have got alone."""
from __future__ import annotations

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsched.core import batching


def _branches(x):
    # Ordered by cost; `covers`: branch k gives branch j's result for index j <= k when x is
    # non-negative (as the scheduler's steady and general steps do).
    return [lambda: x, lambda: jnp.abs(x), lambda: jnp.abs(x) * 1]


def _step(pred, index, x, same):
    work = (lambda v: jnp.where(pred, v * 2, v)) if same else (lambda v: v * 2 + 1)
    a = batching.cond(pred, work, lambda v: v, x, same=same)
    b = batching.switch(index, [lambda: x, lambda: x + 10, lambda: x * 3])
    c = batching.switch(index, _branches(jnp.abs(x)), covers=True)
    return a, b, c


def _batched(skips: bool, same: bool):
    def one(pred, index, x):
        with batching.runs_axis("runs", skips):
            return _step(pred, index, x, same)
    return jax.jit(jax.vmap(one, axis_name="runs"))


@pytest.mark.parametrize("same", [False, True])
@pytest.mark.parametrize("skips", [True, False])
def test_cond_switch__each_run_gets_its_own_branch(skips, same):
    rng = np.random.default_rng(0)
    pred = jnp.asarray(rng.random(16) < 0.3)
    index = jnp.asarray(rng.integers(0, 3, 16), jnp.int32)
    x = jnp.asarray(rng.integers(-50, 50, (16, 5)), jnp.int32)
    got = _batched(skips, same)(pred, index, x)
    want = jax.vmap(lambda p, i, v: _step(p, i, v, same))(pred, index, x)   # no runs axis: lax.cond per run
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def _primitives(jaxpr) -> set[str]:
    out = set()
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out |= _primitives(sub)
    return out


@pytest.mark.parametrize("skips", [True, False])
def test_no_skips__traces_no_conditional(skips):
    """With skips, a skip stays a cond on the batch's `any` (a pmax over the runs); without,
    the step is straight-line code."""
    args = (jnp.zeros(4, bool), jnp.zeros(4, jnp.int32), jnp.zeros((4, 5), jnp.int32))
    prims = _primitives(jax.make_jaxpr(_batched(skips, same=False))(*args).jaxpr)
    assert ("cond" in prims) == skips
    assert ("pmax" in prims or "reduce_max" in prims) == skips


def test_outside_a_batch__plain_conditionals():
    assert batching.current_axis() is None
    with batching.runs_axis("runs", False):
        assert batching.current_axis() == "runs"
    assert batching.current_axis() is None
    out = jax.jit(lambda p, v: batching.cond(p, lambda u: u + 1, lambda u: u, v))(True, jnp.int32(1))
    assert int(out) == 2
    assert "cond" in _primitives(jax.make_jaxpr(
        lambda p, v: batching.cond(p, lambda u: u + 1, lambda u: u, v))(True, 1).jaxpr)
