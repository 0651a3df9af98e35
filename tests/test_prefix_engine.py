"""Prefix caching in the engine (SPEC A10, engine/prefix_reuse.py): a prefill skips the
prompt blocks whose K/V another request (or its own earlier run) left in the pool, and no
output changes: greedy, seeded, n > 1, preemption by recompute and by swap, chunked prefill."""
from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from jaxsched.engine.params import SamplingParams
from models.llama import LlamaForCausalLM
from test_engine import MODEL_CONFIG, VOCAB, make_llm, mixed_params, run

BLOCK = 4                # test_engine's block size


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM(MODEL_CONFIG, nnx.Rngs(0))


def shared_prompts(num: int, seed: int = 0) -> list[list[int]]:
    """Three system prompts of 13..22 tokens, each followed by its own question."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, VOCAB, size=int(rng.integers(13, 23))).tolist() for _ in range(3)]
    return [systems[i % 3] + rng.integers(0, VOCAB, size=int(rng.integers(1, 9))).tolist()
            for i in range(num)]


@pytest.fixture(scope="module")
def workload(model):
    prompts, params = shared_prompts(12, seed=7), mixed_params(12)
    llm = make_llm(model)
    outs = run(llm, prompts, params)
    assert llm.stats()["cached_prompt_tokens"] == 0 and llm.stats()["prefix_cache_hit_rate"] == 0
    return prompts, params, outs


@pytest.mark.parametrize("small", [
    dict(),
    dict(num_device_blocks=24, preemption_mode="recompute"),
    dict(num_device_blocks=24, preemption_mode="swap"),
    dict(num_device_blocks=24),
    dict(num_device_blocks=24, enable_chunked_prefill=True, max_num_batched_tokens=16),
], ids=["roomy", "recompute", "swap", "default", "chunked"])
def test_prefix_caching__skips_cached_prefill_and_changes_no_output(model, workload, small):
    prompts, params, expected = workload
    llm = make_llm(model, enable_prefix_caching=True, **small)
    got = run(llm, prompts, params)             # invariants (the cache's too) after every step
    stats = llm.stats()
    assert got == expected
    assert stats["cached_prompt_tokens"] > 0 and 0 < stats["prefix_cache_hit_rate"] <= 1, stats
    if small:
        assert stats["preempted_recompute"] + stats["preempted_swap"] > 0, stats


def test_prefix_caching__a_repeated_prompt_runs_only_its_last_block(model):
    """The second time a prompt comes, its full blocks are reused, all but the block of its
    last token (whose logits sample): the model runs BLOCK tokens or fewer for it."""
    llm = make_llm(model, enable_prefix_caching=True)
    prompt = shared_prompts(1, seed=8)[0] + [5] * 7
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    first = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    before = dict(llm.stats())
    again = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    after = llm.stats()
    assert again == first
    reused = (len(prompt) - 1) // BLOCK * BLOCK
    assert after["cached_prompt_tokens"] - before["cached_prompt_tokens"] == reused
    assert after["prefix_cache_hit_rate"] > 0


def test_prefix_caching__evicted_blocks_are_not_reused_after_other_tokens_overwrote_them(model):
    """A pool of 8 blocks: every new prompt evicts the last one's blocks, so a prompt that
    comes back finds its keys gone (or their K/V overwritten) and is computed again, with
    the same tokens as the first time."""
    llm = make_llm(model, enable_prefix_caching=True, num_device_blocks=8)
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, VOCAB, size=20).tolist() for _ in range(3)]
    first = [o.outputs[0].token_ids for o in
             (llm.generate([p], greedy, use_tqdm=False)[0] for p in prompts)]
    cached_before = llm.stats()["cached_prompt_tokens"]
    again = llm.generate([prompts[0]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert again == first[0]
    assert llm.stats()["cached_prompt_tokens"] == cached_before      # nothing was left to reuse
