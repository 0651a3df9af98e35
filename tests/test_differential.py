"""Differential test: the jitted scheduler against the plain-Python reference on random traces.

Small caches make preemption, swap, LATER and NEVER happen; every example reuses one
compiled step per mode (one static capacity, the limits vary as arrays). The jitted replay
checks `check_invariants` after every step on device.
"""
from __future__ import annotations

import json
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxsched import simulate
from conftest import TEST_CAPACITY
from jaxsched.reference import simulate_reference


# Cost models for mode "auto" whose float32 arithmetic is exact (integers and a power of two
# times small integers), so a fused multiply-add cannot flip a decision against the reference.
# Each swaps some victims and recomputes others.
AUTO_COSTS = [
    dict(recompute_fixed=8.0, recompute_per_token=1.0, swap_fixed=40.0, swap_per_block=8.0),
    dict(recompute_fixed=0.0, recompute_per_token=1.0, recompute_per_token_sq=2.0 ** -8,
         swap_fixed=64.0, swap_per_block=4.0),
]


@st.composite
def traces(draw, chunked: bool, artificial: bool = False):
    max_num_seqs = draw(st.integers(1, 12))
    budget = draw(st.sampled_from([32, 64, 128, 256, 512]))
    budget = max(budget, max_num_seqs)
    config = {
        "block_size": 16,
        "num_device_blocks": draw(st.integers(6, 64)),
        "num_host_blocks": draw(st.sampled_from([0, 2, 8, 24, 64, 120])),
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": budget,
        "max_model_len": draw(st.sampled_from([48, 128, 256, 512])),
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
    num = draw(st.integers(1, 20))
    step, requests = 0, []
    for i in range(num):
        step += draw(st.integers(0, 4))
        requests.append({"id": f"q{i}", "arrival_step": step,
                         "prompt_len": draw(st.integers(1, 300)),
                         "max_tokens": draw(st.integers(1, 60)),
                         "n": draw(st.sampled_from([1, 1, 2, 3, 4]))})
    return {"config": config, "requests": requests}


def _multiset(step):
    return {k: Counter(json.dumps(x, sort_keys=True) for x in v) if isinstance(v, list) else v
            for k, v in step.items()}


def assert_same_decisions(trace):
    expected = simulate_reference(json.loads(json.dumps(trace)))
    got = simulate(trace["config"], trace["requests"], capacity=TEST_CAPACITY, check_invariants=True)
    assert len(got["steps"]) == len(expected["steps"])
    for mine, theirs in zip(got["steps"], expected["steps"]):
        assert _multiset(mine) == _multiset(theirs), f"step {theirs['step']}"
    assert got["requests"] == expected["requests"]
    assert got["num_preemptions"] == expected["num_preemptions"]
    for step in got["steps"]:
        SEEN.update(p["mode"] for p in step["preempted"])
        SEEN["swapped_in"] += len(step["swapped_in"])
        SEEN["ignored"] += len(step["ignored"])
        SEEN["forked"] += sum(s["num_seqs"] > 1 for s in step["scheduled"])
    return got


SEEN: Counter = Counter()


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                derandomize=True)


@settings(max_examples=100, **SETTINGS)
@given(traces(chunked=False))
def test_differential__default_mode(trace):
    assert_same_decisions(trace)


@settings(max_examples=100, **SETTINGS)
@given(traces(chunked=True))
def test_differential__chunked_prefill(trace):
    assert_same_decisions(trace)


@settings(max_examples=15, **SETTINGS)
@given(traces(chunked=False, artificial=True))
def test_differential__artificial_preemption(trace):
    assert_same_decisions(trace)


def test_differential__random_traces_reached_every_event():
    """The traces above really preempt by both modes, swap back in, ignore and fork."""
    if not SEEN:
        import pytest
        pytest.skip("run together with the differential tests")
    for event in ("recompute", "swap", "swapped_in", "ignored", "forked"):
        assert SEEN[event] > 0, event
