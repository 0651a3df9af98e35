"""The jitted scheduler with prefix caching (SPEC A10): against the reference on shared-prefix
workloads, and with the hash forced tiny. The prefix-* goldens replay in test_scheduler.py."""
from __future__ import annotations

import random

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxsched import SchedulerConfig, add_requests, free_finished, init_state, make_batch, schedule_step, update
from jaxsched.sim.reference import ReferenceScheduler, simulate_reference
from jaxsched.sim.reference import SchedulerConfig as ReferenceConfig
from jaxsched.sim.simulate import chunk_program, simulate
from goldens import assert_same_steps

# One capacity for every workload here (pool sizes and modes are per-run limits).
CAPACITY = dict(num_slots=16, max_seqs_per_group=2, max_blocks_per_seq=16,
                num_device_blocks_capacity=32, num_host_blocks_capacity=32)


def shared_prefix_trace(seed: int, chunked: bool, mode) -> dict:
    """Requests sharing one of two system prompts (some whole prompts repeated), n <= 2, on a
    pool small enough to preempt."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1000) for _ in range(rng.randrange(6, 14))] for _ in range(2)]
    requests = []
    for i in range(10):
        prompt = list(rng.choice(systems))
        if rng.random() < 0.7:
            prompt += [rng.randrange(1000) for _ in range(rng.randrange(1, 12))]
        requests.append({"id": f"r{i}", "arrival_step": rng.randrange(6), "prompt_len": len(prompt),
                         "prompt_token_ids": prompt, "max_tokens": rng.randrange(3, 24),
                         "n": rng.choice([1, 1, 2])})
    config = {"block_size": 4, "num_device_blocks": rng.randrange(14, 24),
              "num_host_blocks": rng.randrange(8, 24), "max_num_seqs": 4,
              "max_num_batched_tokens": 24 if chunked else 64, "max_model_len": 56,
              "enable_chunked_prefill": chunked, "preemption_mode": mode,
              "enable_prefix_caching": True, "step_time": 1.0, "max_steps": 500}
    return {"config": config, "requests": requests}


@pytest.mark.parametrize("chunked", [False, True])
def test_cached_scheduler__decides_as_the_reference_on_shared_prefixes(chunked):
    """Step by step the reference's decisions and free counts, in every preemption mode;
    invariants (the cache's among them) after every step. One compile serves every
    workload (pool sizes and modes are limits)."""
    compiled = None
    # Seeds whose workloads preempt (and, but for "recompute", swap) in both modes.
    for seed, mode in [(0, None), (1, "recompute"), (4, "swap"), (3, "auto")]:
        trace = shared_prefix_trace(seed, chunked, mode)
        got = simulate(trace["config"], trace["requests"], capacity=CAPACITY, check_invariants=True)
        got.pop("ignored_reasons")
        assert_same_steps(got, simulate_reference(trace))
        compiled = compiled or chunk_program()._cache_size()
    assert chunk_program()._cache_size() == compiled


def test_cached_scheduler__tiny_keys_collide_and_every_invariant_still_holds():
    """With 3-bit keys different prefixes share blocks (a wrong share, as a collision is in
    vLLM), so fewer blocks are used than with full keys; every invariant holds at every step
    and every request finishes."""
    trace = shared_prefix_trace(4, False, "swap")
    config, requests = trace["config"], trace["requests"]
    full = simulate(config, requests, capacity=CAPACITY, check_invariants=True)
    tiny = simulate(config, requests, capacity=dict(CAPACITY, prefix_key_bits=3),
                    check_invariants=True)
    assert set(tiny["requests"]) == set(full["requests"]) == {r["id"] for r in requests}
    assert all(r["status"] == "finished_length_capped" for r in tiny["requests"].values())
    peak = lambda result: max(config["num_device_blocks"] - s["num_free_device_blocks"]
                              for s in result["steps"])
    assert peak(tiny) < peak(full)


def _pool_view(state, which: str) -> dict:
    """The jitted pool in the reference's terms: ids shifted down by one."""
    pool = state.pool(which)
    used = int(pool.num_used)
    ref = np.asarray(pool.ref_count)[1:used + 1]
    seq = np.asarray(pool.evict_seq)[1:used + 1]
    evictor = [int(b) for b in np.argsort(np.where(ref == 0, seq, np.iinfo(np.int32).max),
                                          kind="stable")[:int((ref == 0).sum())]]
    return {"num_used": used, "ref_count": ref.tolist(), "evictor": evictor,
            "last_access": np.asarray(pool.last_access)[1:used + 1].tolist(),
            "hashed": np.asarray(pool.num_hashed_tokens)[1:used + 1].tolist(),
            "cached": np.asarray(pool.cached)[1:used + 1].tolist()}


def _reference_view(pool) -> dict:
    used = pool.num_used
    return {"num_used": used, "ref_count": pool.ref_count[:used], "evictor": list(pool.evictor.values()),
            "last_access": pool.last_accessed[:used], "hashed": pool.num_hashed_tokens[:used],
            "cached": [isinstance(k, tuple) for k in pool.key[:used]]}


# The swap seeds swap in unkeyed blocks that the reference takes back from the evictor.
@pytest.mark.parametrize("chunked, seed, mode", [(False, 1, "recompute"), (True, 1, "recompute"),
                                                 (False, 0, "swap"), (True, 3, "swap"),
                                                 (True, 0, None)])
def test_cached_pools__block_for_block_the_reference_pools(chunked, seed, mode):
    """Stepped beside the reference, both pools hold the same blocks after every step:
    reference counts, the evictor's order, access times, tokens covered and which blocks
    hold a content key (swaps included: an unkeyed block keeps its identity)."""
    trace = shared_prefix_trace(seed, chunked, mode)
    config = SchedulerConfig(**{k: v for k, v in trace["config"].items()
                                if k not in ("step_time", "max_steps")}, **CAPACITY)
    cap = config.capacity()
    width = cap.max_blocks_per_seq * cap.block_size
    reference = ReferenceScheduler(ReferenceConfig.from_dict(trace["config"]))
    state = init_state(config)
    reqs = trace["requests"]
    finished, max_evictor, full_pool = 0, 0, False
    for step in range(200):
        arriving = [i for i, r in enumerate(reqs) if r["arrival_step"] == step]
        for i in arriving:
            r = reqs[i]
            reference.add_request(r["id"], r["prompt_len"], r["max_tokens"], r["n"], float(step),
                                  r["prompt_token_ids"])
        rows = [dict(request_index=i, prompt_len=reqs[i]["prompt_len"], n=reqs[i]["n"],
                     max_tokens=reqs[i]["max_tokens"], arrival_time=float(step)) for i in arriving]
        tokens = np.zeros((8, width), np.int32)
        for j, i in enumerate(arriving):
            tokens[j, :reqs[i]["prompt_len"]] = reqs[i]["prompt_token_ids"]
        state, _ = add_requests(state, make_batch(rows, 8).replace(prompt_tokens=jnp.asarray(tokens)))
        state, out = schedule_step(state, cap, float(step))
        state, _, _ = update(state, out.scheduled, out.num_scheduled_tokens, out.is_prefill)
        state, _ = free_finished(state)
        finished += len(reference.process_outputs(reference.schedule(float(step)), step))
        assert _pool_view(state, "dev") == _reference_view(reference.block_manager.device), f"step {step}"
        assert _pool_view(state, "host") == _reference_view(reference.block_manager.host), f"step {step}"
        device = reference.block_manager.device
        max_evictor = max(max_evictor, len(device.evictor))
        full_pool |= device.num_used == device.num_blocks and bool(device.evictor)
        if finished == len(reqs):
            break
    assert finished == len(reqs)
    # The evictor was used, and blocks came out of it once nothing was left unused.
    assert max_evictor >= 4 and full_pool


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**20), chunked=st.booleans(),
       mode=st.sampled_from([None, "recompute", "swap", "auto"]))
def test_cached_scheduler__drawn_shared_prefix_workloads_decide_as_the_reference(seed, chunked, mode):
    """Drawn workloads (shared system prompts, repeated prompts, n <= 2, tiny pools, every
    mode): the reference's decisions at every step and every invariant after every step."""
    trace = shared_prefix_trace(seed, chunked, mode)
    got = simulate(trace["config"], trace["requests"], capacity=CAPACITY, check_invariants=True)
    got.pop("ignored_reasons")
    assert_same_steps(got, simulate_reference(trace))


def test_auto__counts_cached_blocks_as_free_so_a_shared_prefix_recomputes():
    """Costs that make a block's swap 4x cheaper than prefilling its 4 tokens: without the
    cache `auto` swaps every victim; with it a recompute only prefills the last block (the
    rest waits in the evictor), so `auto` recomputes instead; the reference agrees."""
    costs = dict(recompute_fixed=0.0, recompute_per_token=1.0, swap_fixed=0.0, swap_per_block=1.0)
    rng = random.Random(5)
    system = [rng.randrange(1000) for _ in range(24)]
    requests = [{"id": f"r{i}", "arrival_step": i, "prompt_len": 26, "max_tokens": 20,
                 "prompt_token_ids": system + [rng.randrange(1000) for _ in range(2)]}
                for i in range(6)]
    modes = {}
    for caching in (False, True):
        config = {"block_size": 4, "num_device_blocks": 20, "num_host_blocks": 30, "max_num_seqs": 4,
                  "max_num_batched_tokens": 64, "max_model_len": 56, "preemption_mode": "auto",
                  "enable_prefix_caching": caching, "step_time": 1.0, "max_steps": 500}
        jitted = SchedulerConfig(**{k: v for k, v in config.items() if k not in ("step_time", "max_steps")},
                                 preemption_costs=costs)
        got = simulate(jitted, requests, capacity=CAPACITY, check_invariants=True)
        want = simulate_reference({"config": dict(config, preemption_costs=costs), "requests": requests})
        got.pop("ignored_reasons")
        assert_same_steps(got, want)
        modes[caching] = {p["mode"] for s in got["steps"] for p in s["preempted"]}
    assert modes == {False: {"swap"}, True: {"recompute"}}, modes
