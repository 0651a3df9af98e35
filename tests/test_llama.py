"""The paged Llama forward against the dense reference, swaps, retracing, donation, HF loading."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsched.cache import kv_cache as kc
from jaxsched.cache.attention import make_metadata
from models import llama

BLOCK_SIZE, NUM_BLOCKS, NUM_HOST_BLOCKS, MAX_BLOCKS = 4, 48, 16, 12
NUM_TOKENS, NUM_SEQS = 32, 4  # one bucket for every test: each impl compiles once per config


def make_config(num_kv_heads: int = 2, tied: bool = False, **overrides) -> llama.LlamaConfig:
    return llama.LlamaConfig(**{**dict(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=num_kv_heads, rms_norm_eps=1e-6,
        rope_theta=500.0, tie_word_embeddings=tied), **overrides})


@pytest.fixture(scope="module", params=["gqa", "mha"])
def model(request):
    cfg = make_config(num_kv_heads=2 if request.param == "gqa" else 4, tied=request.param == "gqa")
    return llama.LlamaForCausalLM(cfg, nnx.Rngs(request.param == "gqa"))


def make_tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 101, n).tolist()


def dense_logits(model, tokens: list[int]) -> np.ndarray:
    return np.asarray(llama.dense_forward(model, jnp.asarray([tokens], jnp.int32))[0])


class PagedRunner:
    """Plain-Python driver of the paged forward: block tables, a free list, and the cache.

    Blocks are handed out from a shuffled free list, so sequences get scattered,
    non-contiguous blocks. `step` takes {seq name: new tokens} and returns each one's logits.
    """

    def __init__(self, model, impl: str = "chunked", seed: int = 0, forward=llama.forward):
        cfg = model.config
        self.forward = forward
        self.graphdef, self.params = nnx.split(model)
        self.impl = impl
        self.cache = kc.init_kv_cache(cfg.num_hidden_layers, NUM_BLOCKS, NUM_HOST_BLOCKS, BLOCK_SIZE,
                                      cfg.num_key_value_heads, cfg.head_dim)
        self.free = [int(b) for b in np.random.default_rng(seed).permutation(np.arange(1, NUM_BLOCKS))]
        self.tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.host_tables: dict[str, list[int]] = {}

    def step(self, new_tokens: dict[str, list[int]]) -> dict[str, np.ndarray]:
        names = list(new_tokens)
        for name in names:
            table = self.tables.setdefault(name, [])
            done = self.num_computed.setdefault(name, 0)
            while len(table) * BLOCK_SIZE < done + len(new_tokens[name]):
                table.append(self.free.pop())
        md = make_metadata([self.tables[n] for n in names], [self.num_computed[n] for n in names],
                           [len(new_tokens[n]) for n in names], BLOCK_SIZE, MAX_BLOCKS, NUM_TOKENS, NUM_SEQS)
        flat = sum((new_tokens[n] for n in names), [])
        tokens = jnp.asarray(flat + [0] * (NUM_TOKENS - len(flat)), jnp.int32)
        logits, self.cache = self.forward(self.graphdef, self.params, tokens, md.positions, md,
                                           self.cache, impl=self.impl)
        for name in names:
            self.num_computed[name] += len(new_tokens[name])
        return {name: np.asarray(logits[i]) for i, name in enumerate(names)}

    def swap_out(self, name: str) -> None:
        device = self.tables.pop(name)
        host = list(range(len(device)))  # tests swap one sequence at a time
        pairs = jnp.asarray(list(zip(device, host)) + [(kc.PAD_ID, kc.PAD_ID)] * (MAX_BLOCKS - len(device)), jnp.int32)
        self.cache = kc.swap_out(self.cache, pairs, jnp.int32(len(device)))
        self.host_tables[name] = host
        self.free.extend(device)  # LIFO: the next allocation reuses (overwrites) these blocks

    def swap_in(self, name: str) -> None:
        host = self.host_tables.pop(name)
        device = [self.free.pop(0) for _ in host]  # blocks from the other end of the free list
        pairs = jnp.asarray(list(zip(host, device)) + [(kc.PAD_ID, kc.PAD_ID)] * (MAX_BLOCKS - len(host)), jnp.int32)
        self.cache = kc.swap_in(self.cache, pairs, jnp.int32(len(host)))
        self.tables[name] = device


ATOL = 2e-5


@pytest.mark.parametrize("impl", ["chunked", "reference"])
def test_forward__one_shot_prefill_matches_dense(model, impl):
    tokens = make_tokens(23, seed=1)
    got = PagedRunner(model, impl).step({"a": tokens})["a"]
    np.testing.assert_allclose(got, dense_logits(model, tokens)[-1], atol=ATOL)


def test_forward__prefill_in_chunks_matches_dense(model):
    tokens = make_tokens(30, seed=2)
    want, runner = dense_logits(model, tokens), PagedRunner(model, seed=3)
    for start, stop in [(0, 7), (7, 8), (8, 21), (21, 30)]:
        np.testing.assert_allclose(runner.step({"a": tokens[start:stop]})["a"], want[stop - 1], atol=ATOL)


def test_forward__prefill_then_decodes_matches_dense(model):
    tokens = make_tokens(40, seed=4)
    want, runner = dense_logits(model, tokens), PagedRunner(model, seed=5)
    runner.step({"a": tokens[:9]})
    for i in range(9, 40):
        np.testing.assert_allclose(runner.step({"a": [tokens[i]]})["a"], want[i], atol=ATOL)


def _new_kv_then_write(graphdef, params, tokens, positions, metadata, kv_cache, impl):
    """The engine's way: the model only reads the cache; its K/V are written afterwards."""
    logits, (k, v) = llama.paged_forward_new_kv(graphdef, params, tokens, positions, metadata, kv_cache, impl)
    return logits, kc.write_layers(kv_cache, k, v, metadata.slot_mapping)


new_kv_forward = jax.jit(_new_kv_then_write, static_argnames=("graphdef", "impl"), donate_argnames=("kv_cache",))


@pytest.mark.parametrize("path", ["write-through", "new-kv"])
@pytest.mark.parametrize("impl", ["chunked", "reference"])
def test_forward__ragged_mixed_batch_matches_dense(model, impl, path):
    seqs = {name: make_tokens(n, seed) for name, n, seed in [("prefill", 14, 6), ("chunked", 20, 7), ("decode", 17, 8)]}
    want = {name: dense_logits(model, t) for name, t in seqs.items()}
    runner = PagedRunner(model, impl, seed=9, forward=llama.forward if path == "write-through" else new_kv_forward)
    runner.step({"chunked": seqs["chunked"][:6], "decode": seqs["decode"][:12]})
    for i in range(5):  # one prefill, one chunk, one decode per step, all in one flat batch
        batch = {"decode": [seqs["decode"][12 + i]], "chunked": seqs["chunked"][6 + 2 * i: 8 + 2 * i]}
        if i == 2:
            batch["prefill"] = seqs["prefill"]
        for name, logits in runner.step(batch).items():
            pos = runner.num_computed[name] - 1
            np.testing.assert_allclose(logits, want[name][pos], atol=ATOL, err_msg=f"{name} @ {pos}")


def test_forward__swapped_sequence_decodes_like_one_that_never_left(model):
    tokens = make_tokens(30, seed=10)
    stay, swap = PagedRunner(model, seed=11), PagedRunner(model, seed=11)
    for runner in (stay, swap):
        runner.step({"a": tokens[:13]})
    swap.swap_out("a")
    swap.step({"intruder": make_tokens(24, seed=12)})  # reuses and overwrites a's old blocks
    swap.swap_in("a")
    assert set(swap.tables["a"]) != set(stay.tables["a"])
    for i in range(13, 30):
        np.testing.assert_array_equal(swap.step({"a": [tokens[i]]})["a"], stay.step({"a": [tokens[i]]})["a"])


def test_forward__no_retrace_across_100_decodes_in_one_bucket():
    step = jax.jit(chex.assert_max_traces(llama.paged_forward, n=1),
                   static_argnames=("graphdef", "impl"), donate_argnames=("kv_cache",))
    runner = PagedRunner(llama.LlamaForCausalLM(make_config(), nnx.Rngs(0)), forward=step)
    try:
        names = ["a", "b", "c", "d"]
        runner.step({name: make_tokens(5, seed) for seed, name in enumerate(names)})
        for i in range(100):  # batch composition changes, shapes do not
            batch = {names[i % 4]: [i % 101]}
            if i % 3 == 0:
                batch[names[(i + 1) % 4]] = [7]
            runner.step(batch)
    finally:
        chex.clear_trace_counter()


def test_forward__updates_the_donated_pools_in_place():
    """No copy of a whole pool in the compiled forward: each layer writes its K/V into the
    donated cache and reads them back (a pool read after a pending write would be copied)."""
    model = llama.LlamaForCausalLM(make_config(), nnx.Rngs(0))
    runner = PagedRunner(model)
    md = make_metadata([[1, 2]], [0], [5], BLOCK_SIZE, MAX_BLOCKS, NUM_TOKENS, NUM_SEQS)
    text = llama.forward.lower(runner.graphdef, runner.params, jnp.zeros((NUM_TOKENS,), jnp.int32), md.positions,
                               md, runner.cache, impl="chunked").compile().as_text()
    pool = "f32[" + ",".join(map(str, runner.cache.k.shape)) + "]"
    assert not [line for line in text.splitlines() if f"= {pool}" in line and " copy(" in line]


def test_forward__donates_the_cache():
    model = llama.LlamaForCausalLM(make_config(), nnx.Rngs(0))
    runner = PagedRunner(model)
    old = runner.cache
    runner.step({"a": make_tokens(4, 15)})
    assert old.k.is_deleted() and old.v.is_deleted()


def numpy_llama3_inv_freq(dim, theta, factor, low_freq_factor, high_freq_factor, old_context_len):
    """Meta's `apply_scaling`, one frequency at a time, in float64."""
    out = []
    for i in range(0, dim, 2):
        freq = 1.0 / theta ** (i / dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old_context_len / high_freq_factor:
            out.append(freq)
        elif wavelen > old_context_len / low_freq_factor:
            out.append(freq / factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


@pytest.mark.parametrize("factor, head_dim", [(8.0, 128), (32.0, 64)])
def test_rope__llama3_inv_freq_matches_formula(factor, head_dim):
    cfg = llama.llama3_8b(head_dim=head_dim, rope_scaling={
        "rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    got = llama.rope_inv_freq(cfg)
    want = numpy_llama3_inv_freq(head_dim, 500000.0, factor, 1.0, 4.0, 8192)
    assert got.dtype == np.float32 and got.shape == (head_dim // 2,)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    plain = llama.rope_inv_freq(llama.llama3_8b(head_dim=head_dim, rope_scaling=None))
    assert (got <= plain).all() and got[0] == plain[0] and got[-1] == pytest.approx(plain[-1] / factor)


def test_config__presets_are_hashable_with_derived_head_dim():
    smol = llama.smollm2_135m()
    assert smol.head_dim == 64 and smol.tie_word_embeddings and smol.num_key_value_heads == 3
    assert llama.tinyllama_1_1b().head_dim == 64
    assert hash(llama.llama3_8b()) == hash(llama.llama3_8b()) and llama.llama3_8b().rope_type == "llama3"
    hf = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 1, "model_type": "llama", "rope_scaling": None}
    assert llama.LlamaConfig.from_hf(hf).head_dim == 4


to_hf_state_dict = llama.to_hf_state_dict


@pytest.mark.parametrize("tied", [True, False])
def test_load_hf_state_dict__round_trip_reproduces_logits(tied):
    source = llama.LlamaForCausalLM(make_config(tied=tied), nnx.Rngs(1))
    target = llama.LlamaForCausalLM(make_config(tied=tied), nnx.Rngs(2))
    state = to_hf_state_dict(source)
    assert "model.layers.1.self_attn.q_proj.weight" in state and state["model.layers.1.mlp.down_proj.weight"].shape == (64, 96)
    assert ("lm_head.weight" in state) != tied
    llama.load_hf_state_dict(target, state)
    tokens = make_tokens(9, 16)
    np.testing.assert_array_equal(dense_logits(target, tokens), dense_logits(source, tokens))


def test_load_hf_state_dict__names_missing_extra_and_misshaped_tensors():
    model = llama.LlamaForCausalLM(make_config(), nnx.Rngs(1))
    state = to_hf_state_dict(model)
    del state["model.norm.weight"]
    state["model.layers.0.mlp.gate_proj.weight"] = state["model.layers.0.mlp.gate_proj.weight"].T
    state["model.layers.9.mlp.up_proj.weight"] = np.zeros((96, 64), np.float32)
    with pytest.raises(ValueError) as err:
        llama.load_hf_state_dict(model, state)
    for name in ("model.norm.weight", "model.layers.0.mlp.gate_proj.weight", "model.layers.9.mlp.up_proj.weight"):
        assert name in str(err.value)


def unrolled_dense_logits(model, tokens: list[int]) -> np.ndarray:
    """The model as it ran before its layers were scanned: a Python loop, one layer at a time
    (each a slice of the stacked parameters)."""
    graphdef, state = nnx.split(model.model.layers)
    cos, sin = llama.rope_cos_sin(model.config, jnp.arange(len(tokens)))
    h = model.model.embed_tokens(jnp.asarray([tokens], jnp.int32))
    for i in range(model.config.num_hidden_layers):
        layer = nnx.merge(graphdef, jax.tree.map(lambda x: x[i], state))
        h = layer.mlp_block(h + layer.self_attn.dense(layer.input_layernorm(h), cos, sin))
    return np.asarray(model.logits(h)[0])


def test_scan__stacked_layers_match_a_loop_over_them_dense_and_paged(model):
    tokens = make_tokens(11, 17)
    want = unrolled_dense_logits(model, tokens)
    np.testing.assert_allclose(dense_logits(model, tokens), want, atol=ATOL)
    paged = PagedRunner(model).step({"a": tokens})["a"]
    np.testing.assert_allclose(paged, want[-1], atol=ATOL)
    assert paged.argmax() == want[-1].argmax()


def test_scan__parameters_are_stacked_on_a_leading_layer_axis(model):
    cfg = model.config
    q = model.model.layers.self_attn.q_proj.kernel[...]
    assert q.shape == (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim)
    names = llama.hf_param_names(model)
    assert names["model.layers.1.self_attn.q_proj.weight"].layer == 1
    assert names["model.layers.1.self_attn.q_proj.weight"].shape == q.shape[1:][::-1]
