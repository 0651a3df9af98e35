"""The jitted scheduler: golden vLLM traces, invariants, retracing, vmap, SPEC part B."""
from __future__ import annotations

import json
from collections import Counter

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsched
from jaxsched import (SchedulerConfig, TraceError, abort, add_requests, check_invariants,
                      init_state, make_batch, schedule_step, simulate)
from jaxsched.core.scheduler import schedule_impl
from jaxsched.core.state import ABORTED, FINISHED, IGNORED, RUNNING, SWAPPED, WAITING
from conftest import drive, make_config, make_requests
from goldens import assert_replays_golden, assert_same_steps, golden_capacity, golden_cases, load

# One arrival width (the largest burst is 24) and a capacity per group (`golden_capacity`),
# so that the golden traces share a compiled step per (block size, chunked, prefix caching).
GOLDEN_WIDTH = 32


@pytest.mark.parametrize("name", golden_cases(prefix_caching=True))
def test_simulate__replays_golden(name):
    """vLLM's decisions where it has a record; where vLLM fails, every request served to the
    end within the budget. Invariants checked after every step. The prefix-* goldens replay
    with prefix caching on (their config says so), the others with it off."""
    trace = load(name)
    got = simulate(trace["config"], trace["requests"], capacity=golden_capacity(name),
                   arrival_width=GOLDEN_WIDTH, check_invariants=True)
    assert_replays_golden(name, got, statuses={"finished_length_capped", "finished_ignored"})


def test_simulate__an_arrival_width_below_a_burst_is_refused_before_compiling():
    config = dict(block_size=16, num_device_blocks=8, num_host_blocks=0, max_num_seqs=4,
                  max_num_batched_tokens=64, max_model_len=64)
    requests = [{"id": f"r{i}", "arrival_step": 0, "prompt_len": 4, "max_tokens": 2, "n": 1} for i in range(3)]
    with pytest.raises(ValueError, match="arrival_width=2 is below the trace's 3 arrivals"):
        simulate(config, requests, arrival_width=2)


def test_golden_trace__invariants_hold_after_every_step():
    trace = load("default-auto-n2")
    cfg = dict(trace["config"])
    cfg.pop("step_time"), cfg.pop("max_steps")
    config = make_config(**cfg)
    drive(config, trace["requests"])


def test_host_pool_too_small__recomputes_instead_of_raising():
    """SPEC B1: swap space runs out; forked groups are recomputed and everyone finishes."""
    config = make_config(num_device_blocks=24, num_host_blocks=2, preemption_mode="swap",
                         max_num_seqs=8)
    reqs = make_requests(12, seed=3, prompt=(20, 120), max_tokens=(20, 80), max_n=3)
    steps, state, done = drive(config, reqs)
    assert len(done) == len(reqs)
    modes = Counter(int(m) for s in steps for m in s["preempted"] if m)
    assert modes[1] > 0, "expected recompute fallbacks when the host pool is full"
    # Forked groups were recomputed: some preempted group had several sequences.
    assert any(((s["preempted"] == 1) & (s["num_seqs"] == 0)).any() for s in steps)


def test_recompute_mode__forked_group_recomputes_and_finishes():
    """SPEC B1: vLLM asserts on recompute of a forked group; we re-admit it with its seqs."""
    config = make_config(num_device_blocks=20, preemption_mode="recompute", max_num_seqs=8)
    reqs = make_requests(8, seed=5, prompt=(10, 60), max_tokens=(30, 90), max_n=3)
    steps, _, done = drive(config, reqs)
    # Every request ends as the plain-Python statement of SPEC B1 says it does.
    from jaxsched.sim.reference import simulate_reference
    trace = {"config": dict(block_size=16, num_device_blocks=20, num_host_blocks=64, max_num_seqs=8,
                            max_num_batched_tokens=512, max_model_len=512, preemption_mode="recompute"),
             "requests": reqs}
    expected = simulate_reference(trace)["requests"]
    names = {1: "finished_length_capped", 3: "finished_ignored"}
    assert {reqs[i]["id"]: names[r] for i, r in done.items()} == {k: v["status"] for k, v in expected.items()}
    multi = [s for s in steps if (s["is_prefill"] & (s["num_seqs"] > 1)).any()]
    assert multi, "a forked group should have been re-prefilled with all its sequences"


def test_schedule__never_retraces_over_a_long_trace():
    config = make_config(num_device_blocks=40, max_num_seqs=8)
    cap = config.capacity()
    guarded = jax.jit(chex.assert_max_traces(schedule_impl, n=1), static_argnames=("cap",))
    state = init_state(config)
    rows = [dict(request_index=i, prompt_len=30 + 7 * i, n=1 + i % 3, max_tokens=40, arrival_time=0.0)
            for i in range(8)]
    state, _ = add_requests(state, make_batch(rows, 8))
    for step in range(120):
        state, out = guarded(state, cap, jnp.float32(step))
        state, _, _ = jaxsched.update(state, out.scheduled, out.num_scheduled_tokens, out.is_prefill)
        state, _ = jaxsched.free_finished(state)
    chex.clear_trace_counter()


def test_schedule__vmaps_over_states_with_different_limits():
    cap_cfg = make_config(num_device_blocks=64)
    cap = cap_cfg.capacity()
    configs = [make_config(num_device_blocks=b, max_num_seqs=s) for b, s in ((16, 4), (32, 8), (64, 16))]
    rows = [dict(request_index=i, prompt_len=40 + 10 * i, n=1, max_tokens=50, arrival_time=0.0)
            for i in range(6)]
    states = []
    for c in configs:
        st, _ = add_requests(init_state(c), make_batch(rows, 8))
        states.append(st)
    batched = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
    step = jax.jit(jax.vmap(lambda st: schedule_step(st, cap, jnp.float32(0))))
    new, out = step(batched)
    for i, c in enumerate(configs):
        single_state, single_out = schedule_step(states[i], cap, jnp.float32(0))
        mine = jax.tree.map(lambda x: x[i], out)
        for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(single_out)):
            np.testing.assert_array_equal(a, b)
        check_invariants(jax.tree.map(lambda x: x[i], new), c, mine)
    # Smaller caches admit fewer prompts.
    assert int(out.scheduled[0].sum()) < int(out.scheduled[2].sum())


def test_abort__frees_blocks_from_every_queue():
    config = make_config(num_device_blocks=24, num_host_blocks=32, preemption_mode="swap")
    state = init_state(config)
    cap = config.capacity()
    rows = [dict(request_index=i, prompt_len=60, n=2, max_tokens=200, arrival_time=0.0) for i in range(4)]
    state, slots = add_requests(state, make_batch(rows, 4))
    statuses = set()
    for step in range(40):
        state, out = schedule_step(state, cap, float(step))
        state, _, _ = jaxsched.update(state, out.scheduled, out.num_scheduled_tokens, out.is_prefill)
        statuses |= set(np.asarray(state.status)[np.asarray(slots)].tolist())
        if {RUNNING, SWAPPED, WAITING} <= statuses:
            break
    state = abort(state, jnp.ones_like(state.status, bool))
    check_invariants(state, config)
    assert (np.asarray(state.finish_reason)[np.asarray(slots)] == ABORTED).all()
    assert int(np.asarray(state.device_ref).sum()) == 0 and int(np.asarray(state.host_ref).sum()) == 0


def test_add_requests__n_above_max_num_seqs_is_ignored_at_arrival():
    config = make_config(max_num_seqs=2)
    state, slots = add_requests(init_state(config), make_batch(
        [dict(request_index=0, prompt_len=10, n=3, max_tokens=5, arrival_time=0.0),
         dict(request_index=1, prompt_len=10, n=1, max_tokens=5, arrival_time=0.0)], 4))
    s = np.asarray(slots)
    assert int(state.status[s[0]]) == FINISHED and int(state.finish_reason[s[0]]) == IGNORED
    assert int(state.status[s[1]]) == WAITING


def test_simulate__ignores_unservable_requests_with_a_reason():
    cfg = dict(block_size=16, num_device_blocks=8, num_host_blocks=8, max_num_seqs=4,
               max_num_batched_tokens=256, max_model_len=256)
    reqs = [{"id": "huge", "arrival_step": 0, "prompt_len": 200, "max_tokens": 5},
            {"id": "long", "arrival_step": 0, "prompt_len": 300, "max_tokens": 5},
            {"id": "wide", "arrival_step": 0, "prompt_len": 10, "max_tokens": 5, "n": 5},
            {"id": "ok", "arrival_step": 1, "prompt_len": 20, "max_tokens": 5}]
    got = simulate(cfg, reqs)
    status = {k: v["status"] for k, v in got["requests"].items()}
    assert status == {"huge": "finished_ignored", "long": "finished_ignored",
                      "wide": "finished_ignored", "ok": "finished_length_capped"}
    assert set(got["ignored_reasons"]) == {"huge", "long", "wide"}
    assert "max_num_seqs" in got["ignored_reasons"]["wide"]


@pytest.mark.parametrize("trace, message", [
    ({"config": {"block_sise": 16}, "requests": []}, "unknown key 'block_sise'"),
    ({"config": {}, "requests": [{"id": "a", "prompt_len": -1, "max_tokens": 3}]},
     "request 'a': field 'prompt_len' must be >= 1"),
    ({"config": {}, "requests": [{"id": "a", "prompt_len": 4, "max_tokens": 3, "prio": 1}]},
     "request 'a': unknown field 'prio'"),
    ({"config": {}, "requests": [{"id": "a", "prompt_len": 4}]}, "request 'a': missing field 'max_tokens'"),
    ({"config": {}, "requests": [{"id": "a", "prompt_len": 4, "max_tokens": 1},
                                 {"id": "a", "prompt_len": 4, "max_tokens": 1}]}, "duplicate id"),
    ({"config": {"max_num_seqs": 0}, "requests": []}, "max_num_seqs"),
    ({"config": {"preemption_mode": "evict"}, "requests": []}, "preemption_mode"),
    ({"config": {}, "requests": [{"id": "a", "prompt_len": 4.5, "max_tokens": 1}]}, "must be an integer"),
])
def test_simulate__bad_trace_gets_one_clear_error(trace, message):
    with pytest.raises(TraceError, match=message):
        simulate(trace["config"], trace["requests"])


@pytest.mark.parametrize("field, value", [("block_size", 0), ("watermark", 1.5), ("delay_factor", -1),
                                          ("max_num_batched_tokens", 2)])
def test_config__validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"SchedulerConfig.{field}"):
        SchedulerConfig(**{field: value})


def test_cli__simulate_prints_summary_and_one_line_errors(tmp_path, capsys):
    from jaxsched.entrypoints.cli import main
    assert main(["simulate"]) == 0
    assert "preempted_swap" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text('{"config": {}, "requests": [{"id": "x", "prompt_len": 0, "max_tokens": 1}]}')
    assert main(["simulate", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "request 'x': field 'prompt_len'" in err[0]
    assert main(["simulate", str(tmp_path / "missing.json")]) == 2


def test_watermark_band__group_that_can_never_pass_is_ignored_not_stalled():
    """A forked group whose re-admission needs more than num_device_blocks - watermark_blocks
    would be LATER forever (vLLM stalls); jaxsched ignores it, like the reference."""
    from jaxsched.sim.reference import simulate_reference
    trace = {"config": {"block_size": 4, "num_device_blocks": 20, "num_host_blocks": 64, "max_num_seqs": 8,
                        "max_num_batched_tokens": 64, "max_model_len": 256, "enable_chunked_prefill": False,
                        "preemption_mode": "recompute", "delay_factor": 0.0, "watermark": 0.1,
                        "step_time": 1.0, "max_steps": 2000},
             "requests": [{"id": "a", "arrival_step": 0, "prompt_len": 4, "max_tokens": 60, "n": 1},
                          {"id": "b", "arrival_step": 0, "prompt_len": 44, "max_tokens": 60, "n": 2}]}
    expected = simulate_reference(json.loads(json.dumps(trace)))
    got = simulate(trace["config"], trace["requests"], check_invariants=True)
    assert expected["requests"]["b"]["status"] == "finished_ignored"
    assert_same_steps(got, expected)


def test_admitted_entries__row_ranks_equal_the_flat_rank_of_fresh_entries():
    """The admission-only placement ranks fresh blocks row by row; it must agree with the
    flat prefix sum (`mask_rank`) over every [G, S, M] entry, forked groups included."""
    from jaxsched.core.block_pool import mask_rank
    from jaxsched.core.placement import _admitted_entries

    rng = np.random.default_rng(0)
    g, s, m, block_size = 12, 4, 9, 4
    for _ in range(20):
        n_live = rng.integers(1, s + 1, g)
        alive = np.arange(s)[None, :] < n_live[:, None]
        alive[:, 0] &= rng.random(g) < 0.8          # some groups lost sequence 0 (finished)
        alive[~alive.any(1), 0] = True
        leader = np.argmax(alive, 1).astype(np.int32)
        prompt = rng.integers(1, 20, g)
        num_tokens = np.where(alive, prompt[:, None] + rng.integers(0, 12, (g, s)), 0)
        admitted = jnp.asarray(rng.random(g) < 0.5)
        valid, holder, _, rank = _admitted_entries(
            jnp.asarray(alive), jnp.asarray(num_tokens), jnp.asarray(leader),
            jnp.asarray(alive.sum(1).astype(np.int32)), jnp.asarray(prompt // block_size),
            admitted, m, block_size)
        fresh = valid & (holder == jnp.arange(s)[None, :, None])
        assert fresh.any()
        np.testing.assert_array_equal(np.where(fresh, rank, -1), np.where(fresh, mask_rank(fresh), -1))


def _windowed_from_4_slots(monkeypatch, start_slots: int) -> list:
    """simulate windowed past `start_slots` requests, from 4 slots; returns the list that
    gets the num_slots of every replay it makes."""
    import jaxsched.sim.simulate as sim
    from jaxsched.sim.capacity import replay_capacity
    sizes = []
    replay = sim._replay
    monkeypatch.setattr(sim, "_replay", lambda tr, cfg, *a: sizes.append(cfg.num_slots) or replay(tr, cfg, *a))
    monkeypatch.setattr(sim, "START_SLOTS", start_slots)
    monkeypatch.setattr(sim, "replay_capacity", lambda *a, backlog=False, **k: dict(
        replay_capacity(*a, backlog=backlog, **k), **(dict(num_slots=4) if backlog else {})))
    return sizes


def test_simulate__a_long_trace_waits_outside_its_slots_or_gives_each_request_one(monkeypatch):
    """Past START_SLOTS requests, arrivals past the slots wait outside them, behind the
    waiting queue, from the sweep's guess (here 4 slots), and a step whose admission walk
    may have reached past them restarts the replay with twice as many: the same decisions
    as with a slot for every request. Where a request is ignored on arrival (n above
    max_num_seqs, SPEC B6), every request alive gets a slot: from what the trace surely
    has alive at once (`capacity.surely_alive`: 53 of these 60), or from START_SLOTS,
    doubled while more are alive. A num_slots the caller fixed is never raised: too few is
    one clear error."""
    import jaxsched.sim.simulate as sim
    from jaxsched.sim.workload import generate_trace
    trace = generate_trace(60, rate=2.0, seed=5, config=dict(num_device_blocks=64, max_num_seqs=8))
    want = sim.simulate(trace["config"], trace["requests"])          # 64 slots: every request
    sizes = _windowed_from_4_slots(monkeypatch, start_slots=32)
    assert_same_steps(sim.simulate(trace["config"], trace["requests"]), want)
    assert sizes[0] == 4 and len(sizes) > 1 and sizes == [4 << i for i in range(len(sizes))]
    # A request of n=9 that max_num_seqs 8 ignores on arrival: no window.
    ignored = dict(trace, requests=[dict(r, n=9) if i == 30 else r for i, r in enumerate(trace["requests"])])
    want = sim.simulate(ignored["config"], ignored["requests"], capacity=dict(num_slots=64))
    assert any(s["ignored"] for s in want["steps"])
    sizes.clear()
    assert sim.simulate(ignored["config"], ignored["requests"]) == want
    assert sizes == [64]
    sizes.clear()
    monkeypatch.setattr(sim, "surely_alive", lambda *a: 0)
    assert sim.simulate(ignored["config"], ignored["requests"]) == want
    assert sizes == [32, 64]
    with pytest.raises(sim.SlotsExceeded, match=r"more than num_slots=32 requests alive at step \d+"):
        sim.simulate(trace["config"], trace["requests"], capacity=dict(num_slots=32))


def test_simulate__the_window_makes_the_references_decisions(monkeypatch):
    """25 random workloads (test_differential's: tiny pools, forks, chunked prefill, every
    preemption mode), and one with prefix caching (a shared system prompt), replayed with
    arrivals past 4 slots waiting outside them (START_SLOTS 0: every trace windowed),
    restarting with twice the slots while a step's admission may reach past them: every step
    makes the Python reference's decisions."""
    from hypothesis import assume, given, settings
    from hypothesis import strategies as st
    import jaxsched.sim.simulate as sim
    from jaxsched.sim.reference import simulate_reference
    from test_differential import SETTINGS, TEST_CAPACITY, traces

    shared = {k: v for k, v in TEST_CAPACITY.items() if k != "num_slots"}
    sizes = _windowed_from_4_slots(monkeypatch, start_slots=0)

    @settings(max_examples=25, **SETTINGS)
    @given(st.booleans().flatmap(lambda chunked: traces(chunked=chunked)))
    def check(trace):
        assume(all(r["n"] <= trace["config"]["max_num_seqs"] for r in trace["requests"]))
        sizes.clear()
        got = sim.simulate(trace["config"], trace["requests"], capacity=shared, check_invariants=True)
        assert sizes[0] == 4
        seen.append(len(sizes))
        assert_same_steps(got, simulate_reference(json.loads(json.dumps(trace))))
    seen = []
    check()
    assert min(seen) == 1 and max(seen) > 1          # some fit 4 slots, some needed more
    # With prefix caching: the prompts (a shared system prompt) come from the arrival table.
    rng = np.random.default_rng(3)
    system = rng.integers(0, 1000, 24).tolist()
    requests = [{"id": f"r{i}", "arrival_step": i // 6, "prompt_len": 28, "max_tokens": int(rng.integers(2, 12)),
                 "prompt_token_ids": system + rng.integers(0, 1000, 4).tolist()} for i in range(30)]
    config = {"block_size": 4, "num_device_blocks": 40, "num_host_blocks": 30, "max_num_seqs": 4,
              "max_num_batched_tokens": 64, "max_model_len": 64, "preemption_mode": "swap",
              "enable_prefix_caching": True, "step_time": 1.0, "max_steps": 500}
    sizes.clear()
    got = sim.simulate(config, requests, check_invariants=True)
    assert sizes[0] == 4
    assert_same_steps(got, simulate_reference({"config": config, "requests": requests}))


def test_simulate__traces_whose_block_tables_round_alike_share_one_compiled_chunk(monkeypatch):
    """max_blocks_per_seq rounds up to capacity.bucket's steps, so replays of traces whose
    longest sequences need 21 and 23 blocks trace the chunk once (`chex.assert_max_traces`:
    a second trace would raise), and each replays to the end, its own way."""
    from jaxsched.sim import simulate as simulate_module

    guarded = jax.jit(chex.assert_max_traces(simulate_module.run_chunk, n=1), static_argnames=("cap", "check"),
                      donate_argnums=(0,))
    monkeypatch.setattr(simulate_module, "chunk_program", lambda: guarded)
    config = dict(block_size=16, num_device_blocks=40, num_host_blocks=8, max_num_seqs=4,
                  max_num_batched_tokens=512, max_model_len=512)
    steps = []
    for longest, out in ((330, 40), (360, 60)):    # 331 and 361 tokens: 21 and 23 blocks
        requests = [dict(id="a", prompt_len=longest - out, max_tokens=out),
                    dict(id="b", prompt_len=100, max_tokens=30, arrival_step=2)]
        result = jaxsched.simulate(config, requests)
        assert [r["num_output_tokens"] for r in result["requests"].values()] == [out, 30], result["requests"]
        steps.append(len(result["steps"]))
    assert steps == [41, 61]
