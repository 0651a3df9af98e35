"""The engine end to end on a tiny random-weight model: preemption is invisible (SPEC B2/B4)."""
from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsched import check_invariants
from jaxsched.engine.step import LazyStep, finish_impl, model_impl, plan_impl, step_impl
from jaxsched.entrypoints.llm import LLM
from jaxsched.engine.params import SamplingParams
from models.llama import LlamaConfig, LlamaForCausalLM, dense_forward

VOCAB = 97
MODEL_CONFIG = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                           max_position_embeddings=256)
# One capacity for every engine below: the limits vary, the compiled step does not.
ENGINE = dict(block_size=4, num_slots=16, max_seqs_per_group=4, max_num_seqs=8,
              max_num_batched_tokens=64, max_model_len=96, num_device_blocks_capacity=64,
              num_host_blocks_capacity=64)


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM(MODEL_CONFIG, nnx.Rngs(0))


def make_llm(model, **overrides) -> LLM:
    # The reference attention compiles fastest; the kernels themselves are tested in test_llama.
    args = dict(ENGINE, num_device_blocks=64, num_host_blocks=64, attention_impl="reference")
    args.update(overrides)
    return LLM(model, **args)


def make_prompts(num: int, seed: int = 0, lengths=(4, 24)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=int(rng.integers(*lengths))).tolist() for _ in range(num)]


def run(llm: LLM, prompts, params, check=True, prefix="r"):
    """generate(), but stepping by hand so the invariants are checked after every step."""
    ids = [f"{prefix}{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params):
        llm.add_request(rid, prompt, p)
    while llm.has_unfinished():
        llm.step()
        if check:
            check_invariants(llm.state.sched, llm.config)
    return {rid: [o.token_ids for o in llm.output(rid).outputs] for rid in ids}


def mixed_params(num):
    out = []
    for i in range(num):
        if i % 3 == 0:
            out.append(SamplingParams(max_tokens=12 + i % 5, temperature=0.0, n=1 + i % 3))
        else:
            out.append(SamplingParams(max_tokens=10 + i % 7, temperature=0.9, top_p=0.9 if i % 2 else 1.0,
                                      top_k=20 if i % 4 == 1 else -1, seed=100 + i, n=1 + i % 3))
    return out


@pytest.fixture(scope="module")
def baseline(model):
    prompts, params = make_prompts(10, seed=1), mixed_params(10)
    llm = make_llm(model)
    outs = run(llm, prompts, params)
    assert llm.stats()["preempted_recompute"] + llm.stats()["preempted_swap"] == 0
    return prompts, params, outs


@pytest.mark.parametrize("small", [
    dict(num_device_blocks=24, preemption_mode="recompute"),
    dict(num_device_blocks=24, preemption_mode="swap"),
    dict(num_device_blocks=24),                                  # recompute for n=1, swap for n>1
    dict(num_device_blocks=24, preemption_mode="auto",           # by cost: swap long sequences
         preemption_costs=dict(recompute_fixed=0.0, recompute_per_token=1.0, swap_fixed=8.0,
                               swap_per_block=2.0)),
    dict(num_device_blocks=24, num_host_blocks=3, preemption_mode="swap"),   # SPEC B1: host too small
    dict(num_device_blocks=24, enable_chunked_prefill=True, max_num_batched_tokens=16),
    dict(num_device_blocks=40, artificial_preemption=True),
], ids=["recompute", "swap", "default", "auto", "host-too-small", "chunked", "artificial"])
def test_engine__preemption_is_invisible(model, baseline, small):
    prompts, params, expected = baseline
    llm = make_llm(model, **small)
    got = run(llm, prompts, params)
    stats = llm.stats()
    assert stats["preempted_recompute"] + stats["preempted_swap"] > 0, stats
    assert stats["ignored"] == 0
    assert got == expected


def test_engine__greedy_equals_plain_dense_generation(model):
    prompts = make_prompts(6, seed=2)
    llm = make_llm(model, num_device_blocks=20, preemption_mode="swap")
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0), use_tqdm=False)
    width = 48     # one padded length: causal attention ignores the padding to the right
    for prompt, out in zip(prompts, outs):
        ids = list(prompt)
        for _ in range(10):
            padded = jnp.asarray([ids + [0] * (width - len(ids))])
            ids.append(int(jnp.argmax(dense_forward(model, padded)[0, len(ids) - 1])))
        assert out.outputs[0].token_ids == ids[len(prompt):]
        assert out.outputs[0].finish_reason == "length"


def test_engine__no_retrace_over_a_long_mixed_run(model):
    llm = make_llm(model, num_device_blocks=24)
    guarded = jax.jit(chex.assert_max_traces(step_impl, n=1), static_argnames=("spec",), donate_argnums=(0,))
    llm._step = functools.partial(guarded, spec=llm.spec)
    prompts, params = make_prompts(12, seed=3), [SamplingParams(max_tokens=15, temperature=0.0)] * 12
    try:
        got = run(llm, prompts, params, check=False)
        assert llm.stats()["steps"] > 30
    finally:
        chex.clear_trace_counter()
    # The one-program step (every bucket under a lax.switch) and LLM's lazy one agree.
    assert got == run(make_llm(model, num_device_blocks=24), prompts, params, check=False)


def test_engine__lazy_step_compiles_a_bucket_once_when_first_needed(model):
    llm = make_llm(model, num_device_blocks=24)
    buckets = llm.spec.token_buckets
    parts = dict(plan=jax.jit(chex.assert_max_traces(plan_impl, n=1), static_argnames=("spec",), donate_argnums=(0,)),
                 model=jax.jit(chex.assert_max_traces(model_impl, n=len(buckets)), static_argnames=("spec", "size"),
                               donate_argnums=(1,)),
                 finish=jax.jit(chex.assert_max_traces(finish_impl, n=1), static_argnames=("spec",),
                                donate_argnums=(0,)))
    lazy = llm._step = LazyStep(llm.spec, **parts)
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    sizes = lambda: {name: fn._cache_size() for name, fn in parts.items()}  # noqa: E731
    try:
        assert lazy.compiled == []                        # nothing compiled before a step needs it
        run(llm, [[1] * 5], [greedy])
        assert lazy.compiled == [8]                       # prefill of 5 and decodes: one bucket
        before = sizes()
        run(llm, [[2] * 3], [greedy], prefix="b")          # other lengths, the same bucket
        run(llm, [[3] * 7], [greedy], prefix="c")
        assert lazy.compiled == [8] and sizes() == before
        run(llm, [[4] * 20], [greedy], prefix="d")         # a longer prompt: its bucket, once
        assert lazy.compiled == [8, 32]
        before = sizes()
        run(llm, [[5] * 27, [6] * 4], [greedy, greedy], prefix="e")
        assert lazy.compiled == [8, 32] and sizes() == before
        assert before == {"plan": 1, "model": 2, "finish": 1}
    finally:
        chex.clear_trace_counter()


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_engine__step_never_copies_the_kv_pools(model, impl):
    """The cache is donated and updated in place: XLA would copy a whole pool into every
    token-bucket branch that wrote it, so the model only reads it and one scatter after the
    switch writes the step's K/V. Read from the compiled step: no copy of a pool's shape."""
    llm = make_llm(model, attention_impl=impl)
    new = llm._processor.new_requests(0.0)
    compiled = jax.jit(step_impl, static_argnames=("spec",), donate_argnums=(0,)).lower(
        llm.state, llm.params, new, jnp.float32(0), spec=llm.spec).compile()
    pool = "f32[" + ",".join(map(str, llm.state.kv.k.shape)) + "]"
    copies = [line for line in compiled.as_text().splitlines() if f"= {pool}" in line and " copy(" in line]
    assert not copies, copies[:2]


def test_engine__warm_up_runs_every_bucket_and_leaves_nothing_behind(model):
    llm = make_llm(model)
    ran = []
    step = llm._step

    def counting(*args):
        state, out = step(*args)
        ran.append(int(out.num_tokens))
        return state, out

    llm._step = counting
    llm.warm_up()
    buckets = llm.spec.token_buckets
    hit = {buckets[int(np.searchsorted(buckets, n))] for n in ran}
    assert hit == set(buckets) and sorted(step.compiled) == list(buckets)   # all compiled before serving
    assert not llm.has_unfinished()
    check_invariants(llm.state.sched, llm.config)
    assert int(np.asarray(llm.state.sched.device_ref).sum()) == 0   # every block back in the pool
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2


def test_engine__bad_requests_fail_alone(model):
    llm = make_llm(model, num_device_blocks=8)
    llm.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
    # Built when added, as a user builds them: SamplingParams raises on its own fields.
    bad = [
        (("n", [1, 2], dict(n=9)), "max_num_seqs=8"),
        (("t", [1, 2], dict(temperature=-1.0)), "temperature"),
        (("p", [1, 2], dict(top_p=0.0)), "top_p"),
        (("k", [1, 2], dict(top_k=-5)), "top_k"),
        (("mt", [1, 2], dict(max_tokens=0)), "max_tokens"),
        (("vocab", [1, 500]), "vocab_size"),
        (("ok", [4, 5]), "duplicate"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            llm.add_request(*args[:2], *(SamplingParams(**args[2]),) if len(args) > 2 else ())
    # A prompt that can never fit 8 blocks of 4 tokens comes back ignored with a message, and
    # so does one over max_model_len (at once, as in vLLM).
    llm.add_request("huge", list(range(60)), SamplingParams(max_tokens=2))
    llm.add_request("long", list(range(97)) + [1], SamplingParams(max_tokens=2))
    assert llm.output("long").finished and "max_model_len=96" in llm.output("long").message
    llm.add_request("ok2", [7, 8], SamplingParams(max_tokens=3, temperature=0.0))
    while llm.has_unfinished():
        llm.step()
    outs = {rid: llm.output(rid) for rid in ("ok", "huge", "ok2")}
    assert outs["huge"].outputs[0].finish_reason == "ignored" and outs["huge"].message
    assert len(outs["ok"].outputs[0].token_ids) == 4 and len(outs["ok2"].outputs[0].token_ids) == 3


def test_engine__abort_frees_blocks_and_stops_only_that_request(model):
    llm = make_llm(model, num_device_blocks=24)
    for i, prompt in enumerate(make_prompts(4, seed=4)):
        llm.add_request(f"a{i}", prompt, SamplingParams(max_tokens=30, temperature=0.0))
    for _ in range(3):
        llm.step()
    llm.abort("a1")
    while llm.has_unfinished():
        llm.step()
        check_invariants(llm.state.sched, llm.config)
    outs = {f"a{i}": llm.output(f"a{i}") for i in range(4)}
    assert outs["a1"].outputs[0].finish_reason == "abort"
    assert all(outs[f"a{i}"].outputs[0].finish_reason == "length" for i in (0, 2, 3))
    assert int(np.asarray(llm.state.sched.device_ref).sum()) == 0


def test_engine__stop_tokens_min_tokens_and_logprobs(model):
    llm = make_llm(model)
    prompt = make_prompts(1, seed=5)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, logprobs=1), use_tqdm=False)[0]
    toks = free.outputs[0].token_ids
    assert len(free.outputs[0].logprobs) == 12
    assert all(entry[t].logprob <= 0 for t, entry in zip(toks, free.outputs[0].logprobs))
    stop = toks[5]
    first = toks.index(stop)
    stopped = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop,)),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == toks[:first + 1] and stopped.finish_reason == "stop"
    assert stopped.stop_reason == stop
    late = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop,),
                                                 min_tokens=first + 1), use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) > first + 1 and stop not in late.token_ids[:first + 1]


def test_engine__streaming_yields_tokens_as_they_arrive(model):
    llm = make_llm(model, num_device_blocks=24)
    prompts = make_prompts(3, seed=6)
    seen: dict[str, list[int]] = {}
    for out in llm.generate_stream(prompts, SamplingParams(max_tokens=6, temperature=0.0)):
        toks = out.outputs[0].token_ids
        prev = seen.get(out.request_id, [])
        assert toks[:len(prev)] == prev and len(toks) >= len(prev)   # grows, never rewrites
        seen[out.request_id] = toks
    assert sorted(len(t) for t in seen.values()) == [6, 6, 6]


def test_engine__the_plan_compiles_for_speed_of_compile_on_cpu_only(model):
    """The scheduler's half of the step takes LLVM -O0 and the classic emitters on the CPU
    backend; the model and finish keep XLA's options, and other backends keep them all."""
    from jaxsched.engine import compile_options as co
    from jaxsched.engine.step import jitted_part
    assert co.part_options("plan", "cpu") == co.FAST_COMPILE
    assert co.part_options("model", "cpu") == co.part_options("finish", "cpu") == ()
    assert co.part_options("plan", "gpu") == co.part_options("plan", "tpu") == ()
    with pytest.raises(ValueError, match="part must be one of"):
        co.part_options("sample", "cpu")
    lazy = make_llm(model, num_device_blocks=24)._step
    assert lazy._plan is jitted_part("plan", co.part_options("plan"))
    assert lazy._model is jitted_part("model", ()) and lazy._finish is jitted_part("finish", ())
