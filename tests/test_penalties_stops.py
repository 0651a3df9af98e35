"""Penalties (on device, vLLM V0's formulas) and stop strings (on the host), offline."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsched.engine.params import SamplingParams
from jaxsched.engine.sampling import apply_penalties
from models.llama import LlamaConfig, LlamaForCausalLM

ENGINE = dict(block_size=4, num_slots=16, max_seqs_per_group=4, max_num_seqs=8,
              max_num_batched_tokens=64, max_model_len=48, num_device_blocks=64,
              num_host_blocks=64, attention_impl="reference")


def _reference(logits, prompt, output, presence, frequency, repetition):
    """vLLM V0's _apply_penalties for one row, in numpy."""
    out = logits.astype(np.float64).copy()
    counts = np.bincount(output, minlength=len(out)) if len(output) else np.zeros(len(out))
    seen = counts > 0
    seen[list(prompt)] = True
    out[seen] = np.where(out[seen] > 0, out[seen] / repetition, out[seen] * repetition)
    return out - frequency * counts - presence * (counts > 0)


def test_apply_penalties_matches_vllm_formula():
    rng = np.random.default_rng(0)
    v, width = 11, 12
    logits = rng.normal(size=(4, v)).astype(np.float32)
    prompt_len = np.array([3, 2, 4, 1])
    seq_len = np.array([8, 2, 10, 5])
    tokens = rng.integers(0, v, size=(4, width)).astype(np.int32)
    pres = np.array([0.5, 0.0, -1.0, 2.0], np.float32)
    freq = np.array([0.3, 1.0, 0.0, -0.5], np.float32)
    rep = np.array([1.3, 1.0, 0.7, 2.0], np.float32)
    got = np.asarray(apply_penalties(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(tokens),
                                     jnp.asarray(prompt_len), jnp.asarray(seq_len), jnp.asarray(pres),
                                     jnp.asarray(freq), jnp.asarray(rep)))
    for r in range(4):
        want = _reference(logits[r], tokens[r, :prompt_len[r]], tokens[r, prompt_len[r]:seq_len[r]],
                          pres[r], freq[r], rep[r])
        np.testing.assert_allclose(got[r], want, rtol=1e-5, atol=1e-6)
    off = apply_penalties(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(tokens),
                          jnp.asarray(prompt_len), jnp.asarray(seq_len), jnp.zeros(4), jnp.zeros(4), jnp.ones(4))
    np.testing.assert_array_equal(np.asarray(off), logits)


@pytest.mark.parametrize("field,value", [("presence_penalty", 3.0), ("frequency_penalty", -2.5),
                                         ("repetition_penalty", 0.0), ("repetition_penalty", 2.5),
                                         ("stop", [""]), ("stop", [1])])
def test_bad_penalty_or_stop_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}:"):
        SamplingParams(**{field: value})


@pytest.fixture(scope="module")
def llm():
    from jaxsched import LLM
    from models.gguf import find_smollm2_gguf
    from models.tokenizer import Tokenizer
    try:
        tokenizer = Tokenizer.from_gguf_file(find_smollm2_gguf())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True, max_position_embeddings=256)
    return LLM(LlamaForCausalLM(config, nnx.Rngs(0)), tokenizer=tokenizer, **ENGINE)


def _greedy(llm, prompt, **kw):
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, **kw)
    return llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]


def test_presence_penalty_stops_repeats_in_one_compiled_step(llm):
    prompt = [5, 6, 7, 8]
    plain = _greedy(llm, prompt).token_ids
    assert len(set(plain)) < len(plain)                   # a random tiny model repeats itself
    cache = llm._step._cache_size() if hasattr(llm._step, "_cache_size") else None
    penalized = _greedy(llm, prompt, presence_penalty=2.0, repetition_penalty=2.0).token_ids
    assert len(set(penalized)) == len(penalized)
    assert not set(penalized) & set(prompt)               # repetition reaches the prompt too
    assert _greedy(llm, prompt, frequency_penalty=1.5).token_ids != plain
    if cache is not None:
        assert llm._step._cache_size() == cache           # new values, no new compile
    # A penalized request beside a plain one leaves the plain one's tokens alone.
    outs = llm.generate([prompt, prompt], [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                                           SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                          presence_penalty=2.0, repetition_penalty=2.0)],
                        use_tqdm=False)
    assert outs[0].outputs[0].token_ids == plain and outs[1].outputs[0].token_ids == penalized


def test_stop_strings_cut_the_text_and_finish_early(llm):
    full = _greedy(llm, [9, 10, 11])
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop and stop in text
    got = _greedy(llm, [9, 10, 11], stop=[stop, "\x00never"])
    assert got.text == text[:text.find(stop)] and got.finish_reason == "stop"
    assert got.token_ids == full.token_ids[:len(got.token_ids)] and len(got.token_ids) < 24
    assert not llm.has_unfinished()
    # n=2 with both sequences stopped: the request finishes; the engine's blocks come back.
    out = llm.generate([[9, 10, 11]], SamplingParams(n=2, max_tokens=24, temperature=0.0, ignore_eos=True,
                                                     stop=stop), use_tqdm=False)[0]
    assert [c.text for c in out.outputs] == [got.text] * 2 and out.finished
    llm.generate([[1, 2]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # frees the slot
    assert int((np.asarray(llm.state.sched.device_ref)[1:] > 0).sum()) == 0
    # min_tokens holds stop strings back, as vLLM's stop checker does.
    held = _greedy(llm, [9, 10, 11], stop=[stop], min_tokens=23)
    assert len(held.token_ids) >= 23


def test_top_logprobs_best_first_and_greedy_token_on_top(llm):
    out = _greedy(llm, [3, 4, 5], logprobs=3)
    assert len(out.top_logprobs) == len(out.token_ids) == 24
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        ids, lps = list(top), list(top.values())
        assert len(ids) == 3 and lps == sorted(lps, reverse=True) and all(x <= 0 for x in lps)
        assert ids[0] == tok and abs(lps[0] - lp) < 1e-5          # greedy: the sampled one is best
    assert _greedy(llm, [3, 4, 5], logprobs=0).top_logprobs is None
    assert _greedy(llm, [3, 4, 5]).token_ids == out.token_ids


def test_logprobs_limit_names_the_field():
    with pytest.raises(ValueError, match=r"SamplingParams.logprobs: .*\[0, 20\]"):
        SamplingParams(logprobs=21)
