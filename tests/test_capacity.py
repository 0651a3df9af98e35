"""Static sizes for replays (sim/capacity.py): the slots a trace surely needs."""
from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxsched.sim.capacity import surely_alive
from jaxsched.sim.reference import simulate_reference
from jaxsched.sim.trace import parse_trace
from test_differential import SETTINGS, traces


def peak_alive(trace: dict) -> int:
    """The most requests holding a slot at one step of vLLM's replay (the reference): from
    the arrival step through the step that finishes the request."""
    done = simulate_reference(trace)["requests"]
    spans = [(r["arrival_step"], done[r["id"]]["finish_step"]) for r in trace["requests"]]
    return max(sum(a <= t <= f for a, f in spans) for t in range(max(f for _, f in spans) + 1))


@settings(max_examples=150, **SETTINGS)
@given(st.booleans().flatmap(lambda chunked: traces(chunked=chunked)), st.booleans())
def test_surely_alive__never_above_what_a_replay_has_alive(trace, caching):
    """A lower bound: vLLM's own replay has at least that many requests alive at some step,
    in tiny pools, with forks, ignored prompts, preemption, chunked prefill and prefix
    caching (the prompts 0 .. prompt_len - 1 share their prefixes)."""
    trace = dict(trace, config=dict(trace["config"], enable_prefix_caching=caching))
    parsed = parse_trace(trace)
    assert surely_alive(parsed, [parsed.scheduler_config]) <= peak_alive(trace)


def _trace(requests, **config):
    return parse_trace(dict(config=dict(dict(block_size=16, num_device_blocks=64, max_num_seqs=4), **config),
                            requests=[dict(id=f"r{i}", **r) for i, r in enumerate(requests)]))


def test_surely_alive__a_burst_is_alive_at_once_and_a_trickle_is_not():
    """Every request of a burst arrives before any can finish; requests further apart than
    their lifetimes need one slot; a request that some configuration ignores, or whose group
    may outgrow a pool of the grid, is not counted; the sample budget (max_num_seqs a step)
    keeps a stream that arrives faster than it can be served growing."""
    burst = _trace([dict(prompt_len=20, max_tokens=5)] * 30)
    assert surely_alive(burst, [burst.scheduler_config]) == 30
    trickle = _trace([dict(prompt_len=20, max_tokens=5, arrival_step=10 * i) for i in range(30)])
    assert surely_alive(trickle, [trickle.scheduler_config]) == 1
    # max_tokens 5: alive through steps a .. a + 4 at the least, so arrivals 2 apart overlap 3.
    stream = _trace([dict(prompt_len=20, max_tokens=5, arrival_step=2 * i) for i in range(30)])
    assert surely_alive(stream, [stream.scheduler_config]) == 3
    cfg = burst.scheduler_config
    assert surely_alive(burst, [cfg, dataclasses.replace(cfg, max_model_len=16)]) == 0   # prompts too long
    assert surely_alive(burst, [dataclasses.replace(cfg, num_device_blocks=2)]) == 0     # groups may not fit
    # One request a step, 4 samples each, 1 sequence a step: at most one finishes every 4
    # steps, so the queue grows by about 3 a step while requests arrive.
    flood = dict(config=dict(block_size=16, num_device_blocks=64, num_host_blocks=0, max_num_seqs=1,
                             max_num_batched_tokens=2048, max_model_len=1024),
                 requests=[dict(id=f"r{i}", prompt_len=20, max_tokens=4, arrival_step=i) for i in range(40)])
    bound = surely_alive(parse_trace(flood), [parse_trace(flood).scheduler_config])
    assert 40 - 40 // 4 - 1 <= bound <= peak_alive(flood)
    assert type(bound) is int
