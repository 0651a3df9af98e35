"""Prefix caching (SPEC A10) in the reference scheduler: the prefix-* goldens replayed as the
real vLLM 0.5.3 decided them, the cached allocator's invariants after every step, and its
unit semantics (keys, reference counts, the evictor and its order, promotion, swaps)."""

import collections
import copy
import math

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from goldens import assert_matches_vllm, load, prefix_names
from jaxsched.sim.reference import (FINISHED_ABORTED, FINISHED_IGNORED, FINISHED_LENGTH_CAPPED,
                                    FINISHED_STOPPED, BlockManager, CachedBlockPool,
                                    ReferenceScheduler, SchedulerConfig, SchedulerOutputs,
                                    Sequence, SequenceGroup, simulate_reference)
from jaxsched.sim.trace import TraceError, parse_trace

FINAL_STATUSES = {FINISHED_LENGTH_CAPPED, FINISHED_STOPPED, FINISHED_IGNORED, FINISHED_ABORTED}


def make_config(**overrides) -> dict:
    return dict(block_size=4, num_device_blocks=16, num_host_blocks=16, max_num_seqs=4,
                max_num_batched_tokens=64, max_model_len=256, enable_chunked_prefill=False,
                preemption_mode=None, delay_factor=0.0, watermark=0.0, step_time=1.0,
                max_steps=5000, enable_prefix_caching=True) | overrides


def check_pool(pool: CachedBlockPool) -> None:
    """A key maps to at most one block; evictor blocks have ref count 0 and in-use blocks a
    positive one; free = never used + evictor."""
    in_use = [b for b in range(pool.num_blocks) if pool.ref_count[b] > 0]
    assert sorted(pool.cached.values()) == in_use
    assert all(pool.ref_count[b] == 0 for b in pool.evictor.values())
    assert all(b < pool.num_used for b in [*in_use, *pool.evictor.values()])
    for table in (pool.cached, pool.evictor):
        assert all(pool.key[b] == key for key, b in table.items())
    assert not set(pool.cached) & set(pool.evictor)
    assert len(set(pool.cached.values()) | set(pool.evictor.values())) == len(
        pool.cached) + len(pool.evictor)
    assert pool.num_free == pool.num_blocks - pool.num_used + len(pool.evictor)
    assert pool.num_free == pool.num_blocks - len(in_use)


def check_invariants(scheduler: ReferenceScheduler, out) -> None:
    """The pools' own invariants; reference counts are the holders of each block; every
    block a sequence has filled carries its content key; budgets hold."""
    bm, config = scheduler.block_manager, scheduler.config
    assert sum(s.num_tokens if s.is_prefill else s.num_seqs
               for s in out.scheduled) <= config.max_num_batched_tokens
    assert all(s.num_tokens > 0 for s in out.scheduled)
    for queue, pool in ((scheduler.running, bm.device), (scheduler.swapped, bm.host)):
        check_pool(pool)
        holders = collections.Counter(b for g in queue for s in g.live_seqs()
                                      for b in s.block_table)
        assert {b: pool.ref_count[b] for b in range(pool.num_blocks)
                if pool.ref_count[b]} == dict(holders)
        for group in queue:
            for seq in group.live_seqs():
                assert len(seq.block_table) in (math.ceil(seq.num_tokens / bm.block_size),
                                                math.ceil((seq.num_tokens - 1) / bm.block_size))
                for i in range((seq.num_tokens - 1) // bm.block_size):
                    assert pool.key[seq.block_table[i]] == bm.key(seq, i)
    assert all(not s.block_table for g in scheduler.waiting for s in g.seqs)


# ----------------------------------------------------------------------------- golden


# test_reference_golden.py replays every prefix-* golden against vLLM's decisions; here each
# is replayed again with the cached pools' invariants checked after every step.


@pytest.mark.parametrize("name", prefix_names())
def test_reference__prefix_golden_keeps_the_cached_pools_consistent(name):
    simulate_reference(load(name, "trace"), on_step=check_invariants)


@pytest.mark.parametrize("name", prefix_names()[:3])
def test_reference__prefix_goldens_differ_without_caching(name):
    """The goldens do exercise caching: replayed with it off, vLLM's counts are not met."""
    trace = copy.deepcopy(load(name, "trace"))
    trace["config"]["enable_prefix_caching"] = False
    with pytest.raises(AssertionError):
        assert_matches_vllm(simulate_reference(trace), load(name, "vllm"))


# ----------------------------------------------------------------------------- the allocator


def test_cached_pool__a_key_is_one_block_shared_then_evicted_not_freed():
    pool = CachedBlockPool(4)
    a = pool.allocate(("a",), 4)
    assert pool.allocate(("a",), 4) == a and pool.ref_count[a] == 2
    b = pool.allocate(("b",), 8)
    unkeyed = pool.allocate()  # a fresh key: never shared
    assert pool.allocate() != unkeyed
    assert pool.num_free == 0
    check_pool(pool)
    pool.free(a)
    assert pool.num_free == 0 and pool.ref_count[a] == 1
    pool.free(a)
    pool.free(b)
    assert pool.num_free == 2 and list(pool.evictor) == [("a",), ("b",)]
    check_pool(pool)
    # taken back from the evictor by its key, with its id
    assert pool.allocate(("b",), 8) == b and list(pool.evictor) == [("a",)]
    # no never-used block left: a new key takes the evictor's victim
    assert pool.allocate(("c",), 4) == a and pool.key[a] == ("c",)
    assert not pool.contains(("a",))
    check_pool(pool)


def evictor_with(entries) -> CachedBlockPool:
    """A pool whose evictor holds (key, last_accessed, num_hashed_tokens) in this order."""
    pool = CachedBlockPool(len(entries))
    blocks = [pool.allocate(key, tokens) for key, _, tokens in entries]
    for block, (_, time, _) in zip(blocks, entries):
        pool.access(block, time)
        pool.free(block)
    return pool


def test_evictor__oldest_first_then_most_tokens_among_equal_times():
    pool = evictor_with([("a", 1.0, 4), ("b", 1.0, 12), ("c", 1.0, 8), ("d", 2.0, 16)])
    assert [pool.key[pool.evict()] for _ in range(4)] == ["b", "c", "a", "d"]


def test_evictor__walks_in_entry_order_and_stops_at_the_first_later_access():
    # vLLM's walk assumes entry order is access order: it compares each block with its
    # current choice only, so an older block after a later one is never reached, and a
    # later block after an older choice stops the walk.
    pool = evictor_with([("x", 5.0, 4), ("y", 3.0, 8), ("z", 6.0, 16), ("w", 0.0, 32)])
    assert pool.key[pool.evict()] == "y"   # x, then y (not later, more tokens); z stops it
    assert pool.key[pool.evict()] == "x"   # z is later than x: stop at once
    assert pool.key[pool.evict()] == "w"   # w is not later than z and covers more tokens
    assert pool.key[pool.evict()] == "z"
    pool = evictor_with([("z", 6.0, 32), ("w", 0.0, 16)])
    assert pool.key[pool.evict()] == "z"   # w is older, but covers fewer tokens


def make_manager(**overrides) -> BlockManager:
    return BlockManager(SchedulerConfig(**make_config(**overrides)))


def seq_of(ids, outputs=0) -> Sequence:
    return Sequence(len(ids), outputs, tuple(ids))


def test_keys__prefix_content_split_at_the_prompt_as_vllm_hashes_it():
    bm = make_manager(block_size=2)
    seq = seq_of([7, 8, 9], outputs=2)
    assert [bm.key(seq, i) for i in range(3)] == [
        ((7, 8), None), ((7, 8, 9), (1,)), ((7, 8, 9), (1, 1))]
    # the prompt's partial last block: the whole prompt, no outputs yet
    assert bm.key(seq_of([7, 8, 9]), 1) == ((7, 8, 9), ())


def test_admission__shares_in_use_blocks_and_counts_every_block():
    config = make_config(num_device_blocks=8)
    scheduler = ReferenceScheduler(SchedulerConfig(**config))
    system = list(range(100, 108))                              # two full blocks
    scheduler.add_request("a", 10, 20, prompt_token_ids=system + [1, 2])
    scheduler.process_outputs(scheduler.schedule(0.0), 0)
    bm = scheduler.block_manager
    assert bm.device.num_free == 8 - 3
    scheduler.add_request("b", 11, 20, prompt_token_ids=system + [3, 4, 5])
    out = scheduler.schedule(1.0)
    assert [s.group.request_id for s in out.scheduled] == ["b"]
    a, b = (g.seqs[0].block_table for g in scheduler.running)
    assert a[:2] == b[:2] and a[2] != b[2]                       # the system prompt shared
    assert bm.device.num_free == 8 - 4
    check_pool(bm.device)


def test_decode__fills_a_block_and_is_promoted_to_the_same_content_block():
    # Two n=1 requests with the same 3-token prompt (block size 4) share its partial block.
    # Each samples token 1, which fills the block: a's decode finds it shared and copies it
    # on write, the copy getting the full key at once; b's decode then holds the old block
    # alone and promotes it: that full key is in use, so b switches to a's copy and its own
    # block goes to the evictor.
    scheduler = ReferenceScheduler(SchedulerConfig(**make_config(num_device_blocks=4)))
    for rid in ("a", "b"):
        scheduler.add_request(rid, 3, 4, prompt_token_ids=[5, 6, 7])
    bm = scheduler.block_manager
    out = scheduler.schedule(0.0)
    assert len(out.scheduled) == 2 and bm.device.num_free == 3  # one block, ref count 2
    scheduler.process_outputs(out, 0)
    out = scheduler.schedule(1.0)                                # both decode token 4
    assert len(out.blocks_to_copy) == 1                          # a copies the shared block
    a, b = (g.seqs[0] for g in scheduler.running)
    assert a.block_table == b.block_table                        # b switched to a's copy
    assert bm.device.num_free == 3                               # and released its own
    assert bm.device.key[a.block_table[0]] == bm.key(a, 0)
    check_pool(bm.device)


def test_recompute__leaves_the_prompt_cached_and_readmission_takes_it_back():
    scheduler = ReferenceScheduler(SchedulerConfig(**make_config(
        num_device_blocks=8, preemption_mode="recompute")))
    scheduler.add_request("a", 8, 20, prompt_token_ids=list(range(8)))
    for step in range(2):                                        # the prompt, one decode
        scheduler.process_outputs(scheduler.schedule(float(step)), step)
    group = scheduler.running.popleft()
    blocks = list(group.seqs[0].block_table)                     # 2 prompt blocks + 1
    scheduler._preempt(group, SchedulerOutputs())                # as the running walk does
    scheduler.waiting.appendleft(group)
    bm = scheduler.block_manager
    assert bm.device.num_free == 8 and list(bm.device.evictor.values()) == blocks
    out = scheduler.schedule(2.0)
    assert [(s.num_tokens, s.is_prefill) for s in out.scheduled] == [(10, True)]  # all of it
    # the prompt's full blocks are taken back by key; the decode's partial block had no
    # content key, so the last block (prompt + 2 outputs) is a never-used one
    assert group.seqs[0].block_table[:2] == blocks[:2]
    assert group.seqs[0].block_table[2] not in blocks
    assert bm.device.num_free == 8 - 3 and list(bm.device.evictor.values()) == blocks[2:]
    check_pool(bm.device)


def test_swap__keys_travel_and_the_host_pool_dedups():
    bm = make_manager(num_device_blocks=8, num_host_blocks=8)
    groups = [SequenceGroup(rid, 8, 4, 1, 0.0, list(range(8))) for rid in ("a", "b")]
    for g in groups:
        bm.allocate(g)
    device_blocks = list(groups[0].seqs[0].block_table)
    assert groups[1].seqs[0].block_table == device_blocks       # the two share 2 blocks
    assert bm.device.num_free == 6
    bm.move(groups[0], bm.device, bm.host)
    bm.move(groups[1], bm.device, bm.host)
    assert bm.host.num_free == 6 and bm.device.num_free == 8     # shared on the host too
    assert list(bm.device.evictor.values()) == device_blocks     # still cached on device
    back = bm.move(groups[0], bm.host, bm.device)
    assert [d for _, d in back] == device_blocks                 # taken back by key
    assert bm.device.num_free == 6 and not bm.device.evictor
    assert bm.host.num_free == 6                                 # b still holds them there
    for pool in (bm.device, bm.host):
        check_pool(pool)


# ----------------------------------------------------------------------------- properties


@st.composite
def shared_prefix_traces(draw):
    """A few system prompts plus each request's own suffix; n up to 3; tiny pools; every
    preemption mode; chunked or not."""
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    chunked = draw(st.booleans())
    max_num_seqs = draw(st.integers(1, 4))
    budget = draw(st.sampled_from([8, 16, 32, 64]))
    config = make_config(
        block_size=block_size, num_device_blocks=draw(st.integers(4, 24)),
        num_host_blocks=draw(st.sampled_from([0, 4, 16, 64])), max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget if chunked else max(budget, 64, max_num_seqs),
        max_model_len=draw(st.sampled_from([32, 64, 128])), enable_chunked_prefill=chunked,
        preemption_mode=draw(st.sampled_from([None, "recompute", "swap", "auto"])),
        watermark=draw(st.sampled_from([0.0, 0.1])), max_steps=20000)
    token = st.integers(0, 6)                                    # a small vocabulary: collisions
    systems = draw(st.lists(st.lists(token, min_size=0, max_size=24), min_size=1, max_size=3))
    requests = []
    for i in range(draw(st.integers(1, 8))):
        prompt = draw(st.sampled_from(systems)) + draw(st.lists(token, max_size=12))
        prompt = prompt or [0]
        requests.append(dict(id=f"q{i}", arrival_step=draw(st.integers(0, 6)),
                             prompt_len=len(prompt), prompt_token_ids=prompt,
                             max_tokens=draw(st.integers(1, 20)), n=draw(st.integers(1, 3))))
    return {"config": config, "requests": requests}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared_prefix_traces())
def test_reference__prefix_caching_invariants_hold_every_step(trace):
    parse_trace(trace)
    got = simulate_reference(trace, on_step=check_invariants)
    assert {r["status"] for r in got["requests"].values()} <= FINAL_STATUSES
    assert set(got["requests"]) == {r["id"] for r in trace["requests"]}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared_prefix_traces())
@example({"config": {"block_size": 1, "num_device_blocks": 4, "num_host_blocks": 0, "max_num_seqs": 4,
                     "max_num_batched_tokens": 4, "max_model_len": 8, "enable_chunked_prefill": True,
                     "enable_prefix_caching": True, "max_steps": 100},
          "requests": [dict(id="q0", arrival_step=0, prompt_len=1, prompt_token_ids=[0], max_tokens=2, n=1),
                       dict(id="q1", arrival_step=1, prompt_len=1, prompt_token_ids=[0], max_tokens=1, n=1)]})
def test_reference__caching_changes_nothing_without_shared_content(trace):
    """n = 1 and prompts that differ from their first token: no block is ever shared, so
    every decision is the one made with caching off."""
    for i, request in enumerate(trace["requests"]):
        ids = [10**6 + i] + [10**6 + 100 * i + j for j in range(request["prompt_len"] - 1)]
        request.update(prompt_token_ids=ids, n=1)
    off = copy.deepcopy(trace)
    off["config"]["enable_prefix_caching"] = False
    assert simulate_reference(trace, on_step=check_invariants) == simulate_reference(off)


# ----------------------------------------------------------------------------- traces


def trace_with(config=None, **request):
    return {"config": config or {}, "requests": [dict(id="a", prompt_len=3, max_tokens=2)
                                                 | request]}


def test_trace__prompt_token_ids_and_the_caching_switch_parse():
    parsed = parse_trace(trace_with({"enable_prefix_caching": True}, prompt_token_ids=[4, 5, 6]))
    assert parsed.enable_prefix_caching and parsed.requests[0]["prompt_token_ids"] == [4, 5, 6]
    assert not parse_trace(trace_with()).enable_prefix_caching


@pytest.mark.parametrize("request_fields, config, message", [
    ({"prompt_token_ids": [1, 2]}, {}, "field 'prompt_token_ids' has 2 ids, prompt_len is 3"),
    ({"prompt_token_ids": "abc"}, {}, "field 'prompt_token_ids' must be a list"),
    ({"prompt_token_ids": [1, 2, -1]}, {}, "field 'prompt_token_ids' must hold integers"),
    ({"prompt_token_ids": [1, True, 2]}, {}, "field 'prompt_token_ids' must hold integers"),
    ({}, {"enable_prefix_caching": "yes"}, "field 'enable_prefix_caching' must be true or false"),
])
def test_trace__bad_prefix_fields_get_one_line_naming_the_field(request_fields, config, message):
    with pytest.raises(TraceError, match=message) as err:
        parse_trace(trace_with(config, **request_fields))
    assert "\n" not in str(err.value)
