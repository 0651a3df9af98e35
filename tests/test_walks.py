"""The loop-free running walk against the same walk one group at a time (walks.py).

With no forced failures, `running_walk_loop` is vLLM's loop as SPEC A4.4 / A6 / B3 / B5 state
it, so the closed form must agree with it on every input: also where a forked decode past
the budget makes victims or swaps itself out, and where a lone prefill goes on or not.
"""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsched.core.walks import (RANK_BY_COMPARISON_UP_TO, RunningInputs, _sorted_slots, running_walk,
                                  running_walk_loop)

G = 8


def random_walks(rng, cases: int):
    k = rng.integers(1, 5, (cases, G))
    is_prefill = rng.random((cases, G)) < 0.4
    k = np.where(is_prefill & (rng.random((cases, G)) < 0.8), 1, k)      # mostly one sequence
    need = np.where(is_prefill, 0, rng.integers(0, 2, (cases, G)) * k)
    full = np.where(is_prefill, rng.integers(1, 40, (cases, G)), k)
    inp = RunningInputs(num_seqs=k, need=need, held=rng.integers(1, 7, (cases, G)), full=full,
                        is_prefill=is_prefill)
    return (jax.tree.map(lambda x: jnp.asarray(x, jnp.int32 if x.dtype != bool else bool), inp),
            jnp.asarray(rng.integers(0, G + 1, cases), jnp.int32),
            jnp.asarray(rng.integers(0, 12, cases), jnp.int32),
            jnp.asarray(rng.integers(1, 48, cases), jnp.int32),
            jnp.asarray(rng.random(cases) < 0.5))


def test_running_walk__closed_form_equals_the_loop():
    inp, m, free, budget, head = random_walks(np.random.default_rng(0), 4000)
    key = jax.random.PRNGKey(0)

    def both(inp, m, free, budget, head):
        closed = running_walk(inp, m, free, budget, head_recomputes=head)
        loop, _ = running_walk_loop(inp, m, free, budget, key, jnp.int32(0), head_recomputes=head)
        return closed, loop

    closed, loop = jax.jit(jax.vmap(both))(inp, m, free, budget, head)
    for name in ("served", "preempted", "preempt_order"):
        np.testing.assert_array_equal(getattr(closed, name), getattr(loop, name), err_msg=name)
    # The cases the corrected SPEC is about do occur here.
    forked_over = ~inp.is_prefill & (inp.num_seqs > 1)
    stays = forked_over & ~closed.served & ~closed.preempted & (jnp.arange(G) < m[:, None])
    assert bool((stays.any(1) & closed.preempted.any(1)).any()), "a forked decode made victims, then waited"
    real = jnp.arange(G) < m[:, None]
    everyone_out = (closed.preempted == real).all(1) & (m > 0)
    fails_alone = inp.is_prefill[:, 0] & (free + inp.held.sum(1, where=real) - inp.held[:, 0] < 1)
    goes_on = closed.served[:, 0] & (closed.preempted == (real & (jnp.arange(G) >= 1))).all(1)
    assert bool((fails_alone & head & goes_on).any()), "B5: a lone prefill by recompute goes on"
    assert bool((fails_alone & ~head & everyone_out).any()), "B5: by swap it is preempted"
    assert not bool((fails_alone & head & everyone_out).any())


def test_sorted_slots__comparison_count_equals_the_sort():
    """The queue order by counting smaller keys (up to 256 slots) is lax.sort's order, ties in
    every leading key included; above the threshold it is the sort itself."""
    rng = np.random.default_rng(1)
    sorted_slots = jax.jit(_sorted_slots)
    for g in (1, 7, 128, RANK_BY_COMPARISON_UP_TO, RANK_BY_COMPARISON_UP_TO + 1):
        for _ in range(5):
            queue = rng.integers(0, 4, g)
            keys = (jnp.asarray(queue, jnp.int32),
                    jnp.asarray(np.where(queue == 0, 0.0, rng.integers(0, 5, g) * 0.5), jnp.float32),
                    jnp.asarray(rng.integers(0, 6, g), jnp.int32),
                    jnp.asarray(rng.permutation(g), jnp.int32))
            want = lax.sort(keys, num_keys=4)[-1]
            np.testing.assert_array_equal(sorted_slots(keys), want)
