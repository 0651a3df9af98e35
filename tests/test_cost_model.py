"""preemption_mode="auto": the cost model, its fit and file, and the scheduler's choice by cost."""
from __future__ import annotations

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsched import SchedulerConfig, schedule_step, simulate
from jaxsched.core.config import PREEMPT_COST, PREEMPT_DEFAULT, PREEMPT_RECOMPUTE, PREEMPT_SWAP
from jaxsched.core.costs import DEFAULT_COSTS, PreemptionCosts, fit, recompute_seconds, swap_seconds
from jaxsched.engine.cost_measure import measure_preemption_costs
from jaxsched.core.preemption import choose_modes
from jaxsched.core.state import init_state
from conftest import TEST_CAPACITY, drive, make_config, make_requests
from jaxsched.sim.reference import simulate_reference
from test_differential import assert_same_decisions

# Integer costs: every sum and product is exact in float32, so the jitted scheduler and the
# reference agree even where XLA fuses a multiply-add. Swap wins for long sequences in few
# blocks, recompute for short ones.
MIXED = dict(recompute_fixed=8.0, recompute_per_token=1.0, recompute_per_token_sq=0.0,
             swap_fixed=40.0, swap_per_block=8.0)
ALWAYS_RECOMPUTE = dict(MIXED, swap_fixed=1e6)


# ----------------------------------------------------------------------------- the model

def test_fit__recovers_known_coefficients_from_synthetic_points():
    rng = np.random.default_rng(0)
    tokens = np.array([16, 48, 96, 160, 256, 400, 512])
    blocks = np.array([1, 2, 4, 8, 16, 32])
    true = PreemptionCosts(0.03, 2e-3, 1e-6, 4e-4, 3e-4)
    rec = true.recompute_seconds(tokens) * (1 + 1e-4 * rng.standard_normal(tokens.size))
    swp = true.swap_seconds(blocks) * (1 + 1e-4 * rng.standard_normal(blocks.size))
    got = fit(tokens, rec, blocks, swp)
    np.testing.assert_allclose(got.coefficients, true.coefficients, rtol=0.02)
    linear = fit(tokens, tokens * 2e-3 + 0.01, blocks, blocks * 1e-3, quadratic=False)
    np.testing.assert_allclose(linear.coefficients, (0.01, 2e-3, 0.0, 0.0, 1e-3), atol=1e-12)


def test_fit__keeps_every_coefficient_non_negative():
    # Points whose best unconstrained line has a negative intercept and a concave curve.
    got = fit([10, 20, 40], [0.001, 0.03, 0.07], [1, 2, 4], [0.002, 0.001, 0.003])
    assert all(c >= 0 for c in got.coefficients)
    assert got.recompute_seconds(40) == pytest.approx(0.07, rel=0.2)


def test_costs__json_round_trip(tmp_path):
    costs = PreemptionCosts(0.02, 1.5e-3, 2e-7, 3e-4, 1.25e-3)
    path = tmp_path / "costs.json"
    text = costs.to_json(path, backend="cpu", lengths=[16, 64])
    assert json.loads(path.read_text())["backend"] == "cpu"
    assert PreemptionCosts.from_json(path) == costs == PreemptionCosts.from_json(text)
    assert PreemptionCosts.from_json(json.dumps(dict(recompute_fixed=1, recompute_per_token=2))) \
        == PreemptionCosts(1.0, 2.0)
    with pytest.raises(ValueError, match="lacks 'recompute_per_token'"):
        PreemptionCosts.from_json('{"recompute_fixed": 1}')
    with pytest.raises(ValueError, match="no such file"):
        PreemptionCosts.from_json(tmp_path / "missing.json")


@pytest.mark.parametrize("costs, message", [
    (dict(MIXED, swap_per_block=-1.0), "SchedulerConfig.preemption_costs: PreemptionCosts.swap_per_block: "
                                       "must be a finite number >= 0, got -1.0"),
    (dict(MIXED, recompute_fixed=float("nan")), "PreemptionCosts.recompute_fixed: must be a finite"),
    (dict(MIXED, per_page=1.0), "SchedulerConfig.preemption_costs: unknown key 'per_page'"),
    ((1.0, 2.0), "SchedulerConfig.preemption_costs: expected a PreemptionCosts"),
    ("cheap", "SchedulerConfig.preemption_costs: expected a PreemptionCosts"),
])
def test_config__bad_costs_name_the_field(costs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        SchedulerConfig(preemption_mode="auto", preemption_costs=costs)


def test_config__auto_mode_and_costs_are_limits():
    config = SchedulerConfig(preemption_mode="auto", preemption_costs=MIXED)
    assert config.preemption_costs == PreemptionCosts(**MIXED) and hash(config)
    assert config.capacity() == SchedulerConfig().capacity()      # nothing static changes
    lim = init_state(config).limits
    assert int(lim.preemption_mode) == PREEMPT_COST
    assert [float(x) for x in lim.costs] == list(PreemptionCosts(**MIXED).coefficients)
    assert [float(x) for x in init_state(SchedulerConfig()).limits.costs] == \
        list(np.float32(DEFAULT_COSTS.coefficients))
    with pytest.raises(ValueError, match="SchedulerConfig.preemption_mode: must be None or 'default', "
                                         "'recompute', 'swap' or 'auto', got 'lru'"):
        SchedulerConfig(preemption_mode="lru")


# ----------------------------------------------------------------------------- the choice

def _choose(victims, nmax, held, tokens, mode, costs, host_free):
    c = tuple(jnp.float32(x) for x in PreemptionCosts.coerce(costs).coefficients)
    return _choose_jit(jnp.array(victims), jnp.array(nmax, jnp.int32), jnp.array(held, jnp.int32),
                       jnp.array(tokens, jnp.int32), jnp.int32(mode), c, jnp.int32(host_free))


_choose_jit = jax.jit(chex.assert_max_traces(choose_modes, n=1))


def test_choose_modes__auto_swaps_the_cheaper_victims_and_falls_back_when_host_is_short():
    # Walk order: a long sequence in few blocks, a short one, a non-victim, a multi-block group.
    victims, nmax = [True, True, False, True], [1, 1, 1, 3]
    held, tokens = [3, 2, 9, 30], [400, 20, 500, 60]
    try:
        swap, rec = _choose(victims, nmax, held, tokens, PREEMPT_COST, MIXED, host_free=64)
        # swap 40 + 8*3 = 64 < 408; 56 > 28; 280 > 68.
        assert swap.tolist() == [True, False, False, False]
        assert rec.tolist() == [False, True, False, True]
        # Other costs, same compiled function: the quadratic term makes the long group swap.
        costs = dict(MIXED, recompute_per_token_sq=0.0625)
        swap, rec = _choose(victims, nmax, held, tokens, PREEMPT_COST, costs, host_free=64)
        assert swap.tolist() == [True, False, False, True]     # 280 < 8 + 60 * (1 + 3.75); 56 > 53
        # Host short: the tail victim (preempted first) takes the host blocks, the other recomputes.
        swap, rec = _choose(victims, nmax, held, tokens, PREEMPT_COST, costs, host_free=31)
        assert swap.tolist() == [False, False, False, True]
        assert rec.tolist() == [True, True, False, False]
        # The fixed modes ignore the costs.
        swap, _ = _choose(victims, nmax, held, tokens, PREEMPT_DEFAULT, costs, host_free=64)
        assert swap.tolist() == [False, False, False, True]
        swap, _ = _choose(victims, nmax, held, tokens, PREEMPT_SWAP, ALWAYS_RECOMPUTE, host_free=64)
        assert swap.tolist() == [True, True, False, True]
        swap, _ = _choose(victims, nmax, held, tokens, PREEMPT_RECOMPUTE, MIXED, host_free=64)
        assert not swap.any()
    finally:
        chex.clear_trace_counter()


def test_cost_formulas__match_the_dataclass():
    c = DEFAULT_COSTS
    assert recompute_seconds(c.coefficients, 100) == c.recompute_seconds(100) == pytest.approx(
        c.recompute_fixed + 100 * c.recompute_per_token + 1e4 * c.recompute_per_token_sq)
    assert swap_seconds(c.coefficients, 7) == pytest.approx(c.swap_fixed + 7 * c.swap_per_block)


# ----------------------------------------------------------------------------- end to end

@pytest.mark.parametrize("chunked", [False, True], ids=["default", "chunked"])
def test_auto__matches_the_reference_and_mixes_modes(chunked):
    config = dict(block_size=16, num_device_blocks=30, num_host_blocks=24, max_num_seqs=8,
                  max_num_batched_tokens=256, max_model_len=512, enable_chunked_prefill=chunked,
                  preemption_mode="auto", preemption_costs=MIXED, step_time=1.0, max_steps=3000)
    requests = make_requests(16, seed=0, prompt=(10, 200), max_tokens=(5, 60), max_n=3)
    got = assert_same_decisions({"config": config, "requests": requests})
    modes = {p["mode"] for s in got["steps"] for p in s["preempted"]}
    assert modes == {"recompute", "swap"}


def test_auto__invariants_hold_and_costs_never_recompile():
    requests = make_requests(14, seed=4, prompt=(20, 150), max_tokens=(10, 60), max_n=3)
    config = make_config(num_device_blocks=26, num_host_blocks=40, preemption_mode="auto",
                         preemption_costs=MIXED, max_num_seqs=8)
    drive(config, requests)                                  # checks invariants every step
    before = schedule_step._cache_size()
    steps, _, done = drive(make_config(num_device_blocks=26, num_host_blocks=40, preemption_mode="auto",
                                       preemption_costs=ALWAYS_RECOMPUTE, max_num_seqs=8), requests)
    assert schedule_step._cache_size() == before
    assert len(done) == len(requests)
    modes = np.concatenate([s["preempted"] for s in steps])
    assert (modes == 1).any() and not (modes == 2).any()


def test_auto__default_costs_match_the_reference():
    """Without preemption_costs, the jitted scheduler and the reference use the same default."""
    config = dict(block_size=16, num_device_blocks=24, num_host_blocks=16, max_num_seqs=8,
                  max_num_batched_tokens=256, max_model_len=512, preemption_mode="auto")
    requests = make_requests(12, seed=2, prompt=(10, 200), max_tokens=(5, 60), max_n=2)
    expected = simulate_reference({"config": dict(config, step_time=1.0, max_steps=3000),
                                   "requests": requests})
    got = simulate(config, requests, capacity=TEST_CAPACITY)
    assert got["requests"] == expected["requests"] and got["num_preemptions"] > 0


# ----------------------------------------------------------------------------- measuring

def test_measure__times_a_tiny_model_and_fits_non_negative_costs():
    from models.llama import LlamaConfig, LlamaForCausalLM, paged_forward_new_kv

    mc = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                     max_position_embeddings=256)
    graphdef, params = nnx.split(LlamaForCausalLM(mc, nnx.Rngs(0)))
    costs, measured = measure_preemption_costs(
        paged_forward_new_kv, graphdef, params, num_layers=2, num_kv_heads=2, head_dim=mc.head_dim,
        block_size=4, lengths=(8, 32, 128), blocks=(1, 4, 16), reps=2, impl="reference")
    assert measured["lengths"] == [8, 32, 128] and measured["blocks"] == [1, 4, 16]
    assert all(t > 0 for t in measured["recompute_seconds"] + measured["swap_seconds"])
    assert all(c >= 0 and np.isfinite(c) for c in costs.coefficients)
    assert costs.recompute_seconds(32) > 0 and costs.swap_seconds(4) > 0
    assert PreemptionCosts.from_json(costs.to_json(**measured)) == costs


def test_llm__takes_costs_from_a_file_or_measures_them(tmp_path):
    from jaxsched.entrypoints.llm import LLM
    from models.llama import LlamaConfig, LlamaForCausalLM

    mc = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                     max_position_embeddings=256)
    model = LlamaForCausalLM(mc, nnx.Rngs(0))
    engine = dict(block_size=4, num_device_blocks=16, num_host_blocks=16, max_num_seqs=4,
                  max_num_batched_tokens=64, max_model_len=64, preemption_mode="auto",
                  attention_impl="reference")
    path = tmp_path / "costs.json"
    PreemptionCosts(**MIXED).to_json(path)
    llm = LLM(model, preemption_costs=str(path), **engine)
    assert llm.config.preemption_costs == PreemptionCosts(**MIXED)
    assert float(llm.state.sched.limits.swap_fixed) == MIXED["swap_fixed"]
    with pytest.raises(ValueError, match="preemption_costs: no such file"):
        LLM(model, preemption_costs=str(tmp_path / "missing.json"), **engine)
    llm = LLM(model, preemption_costs="measure", **engine)
    costs = llm.config.preemption_costs
    assert costs is not None and llm.cost_measurements["lengths"] == [16, 64, 128, 256]
    assert [float(x) for x in llm.state.sched.limits.costs] == list(np.float32(costs.coefficients))
