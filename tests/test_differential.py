"""Differential test: the jitted scheduler against the plain-Python reference on random traces.

Small caches make preemption, swap, LATER and NEVER happen; every example reuses one
compiled step per mode (one static capacity, the limits vary as arrays). The jitted replay
checks `check_invariants` after every step on device.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxsched import add_requests, free_finished, init_state, make_batch, parse_trace, simulate, update
from jaxsched.core.scheduler import schedule_impl
from jaxsched.core.state import FINISHED
from conftest import TEST_CAPACITY as _SHARED_CAPACITY
from goldens import assert_same_steps
from jaxsched.sim.reference import simulate_reference


# Cost models for mode "auto" whose float32 arithmetic is exact (integers and a power of two
# times small integers), so a fused multiply-add cannot flip a decision against the reference.
# Each swaps some victims and recomputes others.
AUTO_COSTS = [
    dict(recompute_fixed=8.0, recompute_per_token=1.0, swap_fixed=40.0, swap_per_block=8.0),
    dict(recompute_fixed=0.0, recompute_per_token=1.0, recompute_per_token_sq=2.0 ** -8,
         swap_fixed=64.0, swap_per_block=4.0),
]


BLOCK_SIZE = 16
# The traces' own bounds (max_model_len up to 512: 33 blocks; at most 64 device and 120 host
# blocks; 20 requests): a smaller state than the suite's shared capacity, so each of the
# file's several hundred replays steps faster.
TEST_CAPACITY = dict(_SHARED_CAPACITY, max_blocks_per_seq=-(-(512 + 1) // BLOCK_SIZE),
                     num_device_blocks_capacity=64)


def edge_lengths(budget: int) -> list[int]:
    """Prompt lengths on either side of a block boundary and of the token budget."""
    blocks = [k * BLOCK_SIZE + d for k in range(1, 5) for d in (-1, 0, 1)]
    return sorted({x for x in blocks + [budget - 1, budget, budget + 1, 2 * budget] if x >= 1})


@st.composite
def traces(draw, chunked: bool, artificial: bool = False):
    """Random workloads; about half of them in the tight region where vLLM's own edge cases
    live: tiny pools, max_num_seqs 1-2 with n up to 4, chunked budgets of 16-64, bursts of
    simultaneous arrivals, prompts at block and budget edges."""
    tight = draw(st.booleans())
    if tight:
        # A forked decode behind a partial prefill needs 3 or more sequences: some 4s and 8s.
        max_num_seqs = draw(st.sampled_from([1, 2, 1, 2, 4, 8]))
        budget = draw(st.sampled_from([16, 24, 32, 48, 64] if chunked else [16, 32, 64, 128]))
        num_device_blocks = draw(st.integers(2, 24))
        num_host_blocks = draw(st.sampled_from([0, 4, 8, 45, 120]))
        max_model_len = draw(st.sampled_from([48, 128, 256]))
        gap = st.sampled_from([0, 0, 0, 1, 2])
        n = st.sampled_from([1, 2, 1, 2, 3, 4])
        prompt = st.one_of(st.sampled_from(edge_lengths(budget)), st.integers(1, 80),
                           st.integers(budget, 4 * budget))
        max_tokens = st.integers(1, 48)
        num = draw(st.integers(2, 8))
    else:
        max_num_seqs = draw(st.integers(1, 12))
        budget = draw(st.sampled_from([32, 64, 128, 256, 512]))
        num_device_blocks = draw(st.integers(6, 64))
        num_host_blocks = draw(st.sampled_from([0, 2, 8, 24, 64, 120]))
        max_model_len = draw(st.sampled_from([48, 128, 256, 512]))
        gap = st.integers(0, 4)
        n = st.sampled_from([1, 1, 2, 3, 4])
        prompt = st.integers(1, 300)
        max_tokens = st.integers(1, 60)
        num = draw(st.integers(1, 20))
    config = {
        "block_size": BLOCK_SIZE,
        "num_device_blocks": num_device_blocks,
        "num_host_blocks": num_host_blocks,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max(budget, max_num_seqs),
        "max_model_len": max_model_len,
        "enable_chunked_prefill": chunked,
        "preemption_mode": draw(st.sampled_from([None, "recompute", "swap", "auto"])),
        "delay_factor": draw(st.sampled_from([0.0, 0.0, 0.5, 1.5])),
        "watermark": draw(st.sampled_from([0.01, 0.05])),
        "step_time": 1.0, "max_steps": 3000,
    }
    if config["preemption_mode"] == "auto":
        config["preemption_costs"] = draw(st.sampled_from(AUTO_COSTS))
    if artificial:
        config.update(artificial_preemption=True, seed=draw(st.integers(0, 1000)))
    step, requests = 0, []
    for i in range(num):
        step += draw(gap)
        requests.append({"id": f"q{i}", "arrival_step": step, "prompt_len": draw(prompt),
                         "max_tokens": draw(max_tokens), "n": draw(n)})
    return {"config": config, "requests": requests}


@st.composite
def forked_behind_prefills(draw):
    """Chunked: forked groups decoding behind long partial prefills that spend the budget,
    in pools with few blocks to spare (SPEC A6/B3: the forked decode past the budget runs its
    append check; B5: lone partial prefills preempted by swap or recompute)."""
    budget = draw(st.sampled_from([16, 24, 32, 48, 64]))
    config = {
        "block_size": BLOCK_SIZE, "num_device_blocks": draw(st.integers(3, 24)),
        "num_host_blocks": draw(st.sampled_from([0, 4, 8, 45])), "max_num_seqs": 8,
        "max_num_batched_tokens": budget, "max_model_len": 512, "enable_chunked_prefill": True,
        "preemption_mode": draw(st.sampled_from([None, "recompute", "swap", "auto"])),
        "delay_factor": 0.0, "watermark": 0.01, "step_time": 1.0, "max_steps": 3000,
    }
    if config["preemption_mode"] == "auto":
        config["preemption_costs"] = draw(st.sampled_from(AUTO_COSTS))
    # Ties in arrival put groups admitted later ahead of older decodes in `running` (A2, A6).
    arrival = st.sampled_from([0, 0, 1])
    requests = [{"id": f"q{i}", "arrival_step": draw(arrival),
                 "prompt_len": draw(st.integers(1, 64)), "max_tokens": draw(st.integers(2, 40)),
                 "n": draw(st.integers(2, 4))} for i in range(draw(st.integers(1, 2)))]
    for i in range(len(requests), len(requests) + draw(st.integers(1, 3))):
        requests.append({"id": f"q{i}", "arrival_step": draw(arrival),
                         "prompt_len": draw(st.integers(budget - 2, 4 * budget)),
                         "max_tokens": draw(st.integers(1, 10)), "n": 1})
    requests.sort(key=lambda r: r["arrival_step"])
    return {"config": config, "requests": requests}


def assert_same_decisions(trace):
    """Same decisions as the reference at every step; invariants (the budget, no chunk <= 0)
    hold after every step of the jitted replay."""
    expected = simulate_reference(json.loads(json.dumps(trace)))
    got = simulate(trace["config"], trace["requests"], capacity=TEST_CAPACITY, check_invariants=True)
    assert_same_steps(got, expected)
    return got


def events(result: dict) -> Counter:
    """What a replay exercised: preemption modes, swap-in, ignored groups, forked decodes,
    partial prefill chunks, and groups ignored while swapped (never fit again, SPEC B2/B5)."""
    seen, swapped = Counter(), set()
    for step in result["steps"]:
        seen.update(p["mode"] for p in step["preempted"])
        seen["swapped_in"] += len(step["swapped_in"])
        seen["ignored"] += len(step["ignored"])
        seen["ignored_swapped"] += len(swapped & set(step["ignored"]))
        seen["forked"] += sum(s["num_seqs"] > 1 and s["num_tokens"] == 1 for s in step["scheduled"])
        swapped = (swapped - set(step["swapped_in"])) | set(step["swapped_out"])
    return seen


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                derandomize=True)


@settings(max_examples=150, **SETTINGS)
@given(traces(chunked=False))
def test_differential__default_mode(trace):
    assert_same_decisions(trace)


@settings(max_examples=200, **SETTINGS)
@given(traces(chunked=True))
def test_differential__chunked_prefill(trace):
    assert_same_decisions(trace)


@settings(max_examples=60, **SETTINGS)
@given(forked_behind_prefills())
def test_differential__forked_decodes_behind_prefills(trace):
    assert_same_decisions(trace)


@settings(max_examples=15, **SETTINGS)
@given(traces(chunked=False, artificial=True))
def test_differential__artificial_preemption(trace):
    assert_same_decisions(trace)


@settings(max_examples=15, **SETTINGS)
@given(traces(chunked=True, artificial=True))
def test_differential__artificial_preemption_chunked(trace):
    assert_same_decisions(trace)


def test_differential__strategies_reach_every_event():
    """The strategies above really preempt by both modes, swap back in, ignore (also a
    swapped group), and fork. Replayed by the reference alone (the tests above show the
    jitted scheduler decides the same), so this holds whatever ran before it."""
    seen = Counter()
    for chunked in (False, True):
        @settings(max_examples=100, database=None, **SETTINGS)
        @given(traces(chunked=chunked))
        def collect(trace):
            seen.update(events(simulate_reference(trace)))

        collect()
    for event in ("recompute", "swap", "swapped_in", "ignored", "ignored_swapped", "forked"):
        assert seen[event] > 0, event


# The steady-decode shortcut must make the general step's decisions exactly: both from the
# same state at every step of a replay (the same state goes on either way).
@functools.partial(jax.jit, static_argnames=("cap",))
def _both_paths(state, cap, now):
    return (schedule_impl(state, cap, now, steady_path=True),
            schedule_impl(state, cap, now, steady_path=False))


def _replay_both_paths(trace) -> int:
    parsed = parse_trace(trace)
    config = dataclasses.replace(parsed.scheduler_config, **TEST_CAPACITY)
    cap = config.capacity()
    arrivals = parsed.arrivals_by_step()
    state, finished, steps = init_state(config), 0, 0
    while finished < len(parsed.requests):
        assert steps < parsed.max_steps
        rows = [dict(request_index=i, prompt_len=parsed.requests[i]["prompt_len"],
                     n=parsed.requests[i]["n"], max_tokens=parsed.requests[i]["max_tokens"],
                     arrival_time=steps * parsed.step_time) for i in arrivals.get(steps, [])]
        for k in range(0, len(rows), 8):
            state, _ = add_requests(state, make_batch(rows[k:k + 8], 8))
        (fast, fast_out), (slow, slow_out) = _both_paths(state, cap, jnp.float32(steps * parsed.step_time))
        for a, b in zip(jax.tree.leaves((fast, fast_out)), jax.tree.leaves((slow, slow_out))):
            np.testing.assert_array_equal(a, b, err_msg=f"step {steps}")
        state, _, _ = update(slow, slow_out.scheduled, slow_out.num_scheduled_tokens, slow_out.is_prefill)
        finished += int((np.asarray(state.status) == FINISHED).sum())
        state, _ = free_finished(state)
        steps += 1
    return steps


@settings(max_examples=25, **SETTINGS)
@given(st.booleans().flatmap(lambda chunked: traces(chunked=chunked)))
def test_steady_path__makes_the_general_steps_decisions(trace):
    _replay_both_paths(trace)
