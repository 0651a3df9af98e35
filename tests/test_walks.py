"""The loop-free running walk against the same walk one group at a time (walks.py).

With no forced failures, `running_walk_loop` is vLLM's loop as SPEC A4.4 / A6 / B3 / B5 state
it, so the closed form must agree with it on every input: also where a forked decode past
the budget makes victims or swaps itself out, and where a lone prefill goes on or not.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxsched.core.walks import (BIG, RANK_BY_COMPARISON_UP_TO, REPAIR_FROM_SLOTS, REPAIR_UP_TO,
                                  RunningInputs, _lex_less, _out_of_place, _repaired, _sorted_slots,
                                  prefix_walk, running_walk, running_walk_loop)
from jaxsched.sim.reference import simulate_reference
from jaxsched.sim.simulate import simulate
from jaxsched.sim.workload import LogNormal, generate_trace
from goldens import assert_same_steps

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


def test_running_walk__block_slack_is_the_margin_of_its_append_checks():
    """With `block_slack` fewer free blocks the walk is the same; with one more fewer a check
    fails. A negative slack is a failed check: a preemption, or B5's lone prefill going on."""
    inp, m, free, budget, head = random_walks(np.random.default_rng(2), 4000)
    walk = jax.jit(jax.vmap(lambda i, m, f, b, h: running_walk(i, m, f, b, head_recomputes=h)))
    base = walk(inp, m, free, budget, head)
    slack = np.asarray(base.block_slack)
    tracked = (slack >= 0) & (slack < BIG)
    assert tracked.sum() > 500 and (slack < 0).sum() > 500
    less = lambda extra: walk(inp, m, free - np.where(tracked, slack + extra, 0), budget, head)  # noqa: E731
    same, tight = less(0), less(1)
    for name in ("served", "preempted"):
        np.testing.assert_array_equal(np.asarray(getattr(same, name))[tracked],
                                      np.asarray(getattr(base, name))[tracked], err_msg=name)
    assert (np.asarray(same.block_slack)[tracked] == 0).all()
    assert (np.asarray(tight.block_slack)[tracked] == -1).all()
    preempted = np.asarray(base.preempted).any(1)
    lone = (np.asarray(m) == 1) & np.asarray(base.served)[:, 0] & np.asarray(inp.is_prefill)[:, 0]
    assert not preempted[slack >= 0].any()
    assert (preempted | lone)[slack < 0].all()
    assert np.asarray(tight.preempted).any(1)[tracked & ~np.asarray(inp.is_prefill)[:, 0]].all()


def test_prefix_walk__with_its_slack_less_the_walk_is_the_same():
    """Free blocks or sequences left lowered by the reported slack leave the walk as it was;
    a negative slack means a block or sequence test failed (the walk stopped early)."""
    rng = np.random.default_rng(3)
    cases = 4000
    ints = lambda lo, hi, shape=(cases, G): jnp.asarray(rng.integers(lo, hi, shape), jnp.int32)  # noqa: E731
    args = dict(skip=jnp.asarray(rng.random((cases, G)) < 0.1), test_need=ints(1, 6), consume=ints(1, 6),
                tokens=ints(1, 40), chunkable=jnp.asarray(rng.random((cases, G)) < 0.3), seqs=ints(1, 4),
                m=ints(0, G + 1, (cases,)), free=ints(0, 40, (cases,)), watermark=ints(0, 3, (cases,)),
                token_left=ints(20, 200, (cases,)), seq_left=ints(0, 16, (cases,)))
    walk = jax.jit(jax.vmap(lambda a: prefix_walk(**a)))
    base = walk(args)
    for name, arg in (("block_slack", "free"), ("seq_slack", "seq_left")):
        slack = np.asarray(getattr(base, name))
        tracked = (slack >= 0) & (slack < BIG)
        assert tracked.sum() > 500 and (slack < 0).sum() > 200, name
        less = walk(dict(args, **{arg: args[arg] - np.where(tracked, slack, 0)}))
        for field in ("served", "skipped", "chunk"):
            np.testing.assert_array_equal(np.asarray(getattr(less, field))[tracked],
                                          np.asarray(getattr(base, field))[tracked],
                                          err_msg=f"{name} {field}")
        assert (np.asarray(getattr(less, name))[tracked] == 0).all()
        served = np.asarray(base.served | base.skipped).sum(1)
        assert (served < np.asarray(args["m"]))[slack < 0].all(), name


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


def _ascending(keys):
    return np.asarray(_lex_less([k[:-1] for k in keys], [k[1:] for k in keys]))


def test_repaired__slots_that_moved_are_reranked_into_the_sorted_order():
    """A sorted order, then a few slots change queue or keys as a step's admissions,
    finishes, arrivals and requeues do: the moved slots re-ranked give lax.sort's order
    whenever the result is strictly ascending (`queues` sorts otherwise), and they do in
    most cases, so the repair, not the fallback, is what is tested."""
    rng = np.random.default_rng(2)
    g = 64
    repaired = jax.jit(_repaired)
    checked = 0
    for case in range(60):
        queue = rng.integers(0, 4, g)
        arrival = np.where((queue == 1) | (queue == 2), rng.integers(0, 8, g) * 0.5, 0.0)
        key = np.where(queue < 3, rng.integers(-20, 40, g), 0)
        old = tuple(jnp.asarray(x, t) for x, t in ((queue, jnp.int32), (arrival, jnp.float32),
                                                 (key, jnp.int32), (np.arange(g), jnp.int32)))
        order = np.asarray(lax.sort(old, num_keys=4)[-1])
        # A few slots move: a new queue (and arrival, key), or a new key in the same queue.
        for s in rng.choice(g, rng.integers(1, 6), replace=False):
            if rng.random() < 0.6:
                queue[s] = rng.integers(0, 4)
                arrival[s] = rng.integers(0, 8) * 0.5 if queue[s] in (1, 2) else 0.0
            key[s] = rng.integers(-20, 40) if queue[s] < 3 else 0
        new = (queue.astype(np.int32), arrival.astype(np.float32), key.astype(np.int32),
               np.arange(g, dtype=np.int32))
        want = np.asarray(lax.sort(tuple(map(jnp.asarray, new)), num_keys=4)[-1])
        keys = tuple(jnp.asarray(k[order]) for k in new)           # at the stale order's positions
        counts = jnp.asarray([(queue == q).sum() for q in range(3)], jnp.int32)
        moved = _out_of_place(keys[0], jnp.asarray(_ascending(keys)), counts)
        if int(moved.sum()) > REPAIR_UP_TO:
            continue
        got = np.asarray(repaired(keys, moved))
        if _ascending(tuple(k[got] for k in new)).all():
            np.testing.assert_array_equal(got, want, err_msg=f"case {case}")
            checked += 1
    assert checked >= 40, f"only {checked} of 60 stale orders repaired"


@pytest.mark.parametrize("caching", [False, True], ids=["plain", "prefix-caching"])
def test_queues__a_replay_whose_orders_are_repaired_decides_as_the_reference(caching):
    """simulate with REPAIR_FROM_SLOTS slots (stale orders repaired) makes the plain-Python
    reference scheduler's decisions at every step, its invariants checked on device; with
    prefix caching too (SPEC A10 walks the queues group by group)."""
    trace = generate_trace(200, rate=0.6, prompt=LogNormal(4.0, 0.6), output=LogNormal(3.2, 0.6),
                           n_share=0.3, seed=3,
                           config=dict(num_device_blocks=64, num_host_blocks=64, max_num_seqs=24,
                                       max_num_batched_tokens=512, max_model_len=512,
                                       preemption_mode="swap", enable_prefix_caching=caching))
    rng = np.random.default_rng(4)
    for r in trace["requests"]:             # a shared 32-token system prompt, then the request's own
        n = r["prompt_len"]
        r["prompt_token_ids"] = list(range(min(32, n))) + rng.integers(100, 30000, max(0, n - 32)).tolist()
    got = simulate(trace["config"], trace["requests"], capacity=dict(num_slots=REPAIR_FROM_SLOTS),
                   check_invariants=True)
    assert_same_steps(got, simulate_reference(json.loads(json.dumps(trace))))
    assert got["num_preemptions"] > 0                                   # queues really moved
