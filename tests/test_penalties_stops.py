"""Penalties (on device, vLLM V0's formulas), stop strings and tokens (on the host), and vLLM's
other sampling and output fields (best_of, logprobs as dicts, stop_reason, detokenize,
truncate_prompt_tokens), offline."""
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


def test_logprobs__vllms_dicts_best_first_with_ranks_and_text(llm):
    out = _greedy(llm, [3, 4, 5], logprobs=3)
    assert len(out.logprobs) == len(out.token_ids) == 24
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert list(entry)[0] == tok                               # vLLM's order: the sampled one first
        ranked = sorted(entry.items(), key=lambda e: e[1].rank)
        assert [lp.rank for _, lp in ranked] == [1, 2, 3]
        values = [lp.logprob for _, lp in ranked]
        assert values == sorted(values, reverse=True) and all(x <= 0 for x in values)
        assert ranked[0][0] == tok and len(entry) == 3            # greedy: the sampled one is best
        assert all(lp.decoded_token == llm.tokenizer.decode([t], skip_special_tokens=True)
                   for t, lp in entry.items())
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))
    # logprobs=0: the sampled token's only, unranked (the step ranks the top k only).
    zero = _greedy(llm, [3, 4, 5], logprobs=0)
    assert all(list(e) == [t] and e[t].rank is None for t, e in zip(zero.token_ids, zero.logprobs))
    plain = _greedy(llm, [3, 4, 5])
    assert plain.logprobs is None and plain.token_ids == out.token_ids
    assert plain.cumulative_logprob == pytest.approx(out.cumulative_logprob, abs=1e-4)


def test_logit_bias__on_device_per_request_without_recompiling(llm):
    prompt = [5, 6, 7, 8]
    plain = _greedy(llm, prompt, logprobs=1)
    cache = llm._step._cache_size() if hasattr(llm._step, "_cache_size") else None
    banned = _greedy(llm, prompt, logit_bias={plain.token_ids[0]: -100})
    assert banned.token_ids[0] != plain.token_ids[0]
    forced = 1234
    assert forced not in plain.token_ids
    outs = llm.generate([prompt, prompt], [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1),
                                           SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                          logprobs=1, logit_bias={forced: 100.0})],
                        use_tqdm=False)
    assert outs[0].outputs[0].token_ids == plain.token_ids                    # the row beside it is untouched
    assert outs[1].outputs[0].token_ids == [forced] * 24
    assert outs[1].outputs[0].logprobs[0][forced].logprob > -1e-3            # the bias is in the log-probs too
    if cache is not None:
        assert llm._step._cache_size() == cache
    with pytest.raises(ValueError, match=r"SamplingParams.logit_bias: token ids must be in \[0, vocab_size="):
        llm.generate([prompt], SamplingParams(logit_bias={llm.model_config.vocab_size: 1.0}), use_tqdm=False)


def test_stops__stop_reason_and_include_stop_str_in_output_as_vllm(llm):
    full = _greedy(llm, [9, 10, 11])
    text, toks = full.text, full.token_ids
    stop = text[len(text) // 2: len(text) // 2 + 3]
    got = _greedy(llm, [9, 10, 11], stop=[stop])
    assert got.stop_reason == stop and got.finish_reason == "stop"
    kept = _greedy(llm, [9, 10, 11], stop=[stop], include_stop_str_in_output=True)
    assert kept.text == text[:text.find(stop) + len(stop)] and kept.stop_reason == stop
    assert kept.token_ids == got.token_ids
    # A stop token id: its id is the last token, its text left out unless asked for.
    k = next(i for i in range(3, 24) if llm.tokenizer.decode([toks[i]]).strip() and toks[i] not in toks[:i])
    at = _greedy(llm, [9, 10, 11], stop_token_ids=[toks[k]])
    assert at.token_ids == toks[:k + 1] and at.stop_reason == toks[k] and at.finish_reason == "stop"
    assert at.text == llm.tokenizer.decode(toks[:k], skip_special_tokens=True)
    with_it = _greedy(llm, [9, 10, 11], stop_token_ids=[toks[k]], include_stop_str_in_output=True)
    assert with_it.text == llm.tokenizer.decode(toks[:k + 1], skip_special_tokens=True)
    assert full.stop_reason is None and full.finish_reason == "length"


def test_best_of__returns_the_n_most_likely_of_best_of_samples(llm):
    prompt = [7, 8, 9]
    every = llm.generate([prompt], SamplingParams(n=4, max_tokens=8, seed=11, ignore_eos=True),
                         use_tqdm=False)[0].outputs
    assert len({tuple(c.token_ids) for c in every}) > 1          # the samples differ
    best = llm.generate([prompt], SamplingParams(n=2, best_of=4, max_tokens=8, seed=11, ignore_eos=True),
                        use_tqdm=False)[0].outputs
    want = sorted(every, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in best] == [c.token_ids for c in want]
    assert [c.index for c in best] == [c.index for c in want]
    assert best[0].cumulative_logprob >= best[1].cumulative_logprob
    # best_of is what the engine samples, so its limits bound it.
    with pytest.raises(ValueError, match=r"SamplingParams.best_of: 8 exceeds max_num_seqs=8|"
                                         r"SamplingParams.best_of: 8 exceeds the engine's max_seqs_per_group=4"):
        llm.generate([prompt], SamplingParams(n=2, best_of=8), use_tqdm=False)
    assert not llm.has_unfinished()


def test_detokenize_false_truncate_prompt_tokens_and_metrics(llm):
    ids = _greedy(llm, [3, 4, 5], detokenize=False, logprobs=1)
    assert ids.text == "" and len(ids.token_ids) == 24
    assert all(lp.decoded_token is None for e in ids.logprobs for lp in e.values())
    short = llm.generate([list(range(3, 13))], SamplingParams(max_tokens=2, truncate_prompt_tokens=4),
                         use_tqdm=False)[0]
    assert short.prompt_token_ids == [9, 10, 11, 12]
    m = short.metrics                                   # vLLM's RequestMetrics, in time.time()
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert m.time_in_queue == pytest.approx(m.first_scheduled_time - m.arrival_time)


@pytest.mark.parametrize("field,value", [("use_beam_search", True), ("length_penalty", 0.5),
                                         ("early_stopping", True), ("prompt_logprobs", 1),
                                         ("logits_processors", [lambda ids, logits: logits]),
                                         ("best_of", 1), ("truncate_prompt_tokens", 0),
                                         ("skip_special_tokens", "no"), ("logit_bias", {1: 101}),
                                         ("logit_bias", {-1: 1.0}), ("logit_bias", {i: 1.0 for i in range(301)})])
def test_vllm_fields_jaxsched_lacks_are_one_clear_error(field, value):
    kw = {field: value, "n": 2} if field == "best_of" else {field: value}
    with pytest.raises(ValueError, match=f"SamplingParams.{field}:"):
        SamplingParams(**kw)


def test_logprobs_limit_names_the_field():
    with pytest.raises(ValueError, match=r"SamplingParams.logprobs: .*\[0, 20\]"):
        SamplingParams(logprobs=21)
