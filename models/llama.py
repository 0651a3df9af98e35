"""Llama-family decoder (Llama 2/3, TinyLlama, SmolLM2) in Flax NNX on jaxsched's paged KV cache.

Module and parameter names follow Hugging Face's, with the decoder layers stacked: one
`LlamaDecoderLayer` whose parameters carry a leading layer axis, run by `lax.scan`, so the
compiled program holds one layer, not num_hidden_layers copies (compile time no longer grows
with depth). `model.layers.3.self_attn.q_proj.weight` is
`model.model.layers.self_attn.q_proj.kernel[3]` (transposed: HF Linear weights are [out, in],
NNX kernels [in, out]); `hf_param_names` maps every HF name to its place. Two entry points:

  forward(graphdef, params, tokens, positions, metadata, kv_cache) -> (logits, kv_cache)
      the serving step: a flat ragged batch through the paged cache, jitted, cache donated
      (`paged_forward` is the same function unjitted, to wrap in your own jit;
      `paged_forward_new_kv` returns the step's K/V instead of writing them, for callers
      such as the engine that write the cache themselves);
  dense_forward(model, tokens[B, T]) -> logits[B, T, V]
      plain full-sequence causal attention, no cache: the reference the paged path must match.
"""

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsched.cache.attention import AttentionMetadata, StepKV, Visibility, paged_attention, step_visibility
from jaxsched.cache.kv_cache import KVCache, write_kv
from models.host import aligned_empty


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Static, hashable model configuration (HF `config.json` field names).

    Attributes:
      head_dim: defaults to hidden_size // num_attention_heads.
      rope_scaling: None, or HF's dict (given as a dict or as sorted (key, value) pairs; it is
        stored as the latter to stay hashable). rope_type "default", "linear" or "llama3".
      dtype: parameter and activation dtype name, e.g. "float32" or "bfloat16".
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Any = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 2048
    dtype: str = "float32"

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope_type {self.rope_type!r}")

    @property
    def rope_type(self) -> str:
        scaling = dict(self.rope_scaling or ())
        return scaling.get("rope_type", scaling.get("type", "default"))

    @classmethod
    def from_hf(cls, hf: dict, dtype: str = "float32") -> "LlamaConfig":
        """From a parsed HF config.json; unknown keys are ignored."""
        names = {f.name for f in dataclasses.fields(cls)} - {"dtype"}
        return cls(**{k: v for k, v in hf.items() if k in names and v is not None}, dtype=dtype)


def smollm2_135m(**overrides) -> LlamaConfig:
    return LlamaConfig(**{**dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
        tie_word_embeddings=True, max_position_embeddings=8192), **overrides})


def tinyllama_1_1b(**overrides) -> LlamaConfig:
    return LlamaConfig(**{**dict(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048), **overrides})


def llama3_8b(**overrides) -> LlamaConfig:
    """Llama-3.1-8B; Llama-3.2-1B is llama3_8b(hidden_size=2048, intermediate_size=8192,
    num_hidden_layers=16, head_dim=64, tie_word_embeddings=True, rope_scaling={..., factor 32})."""
    return LlamaConfig(**{**dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=131072), **overrides})


def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """float32[head_dim // 2] inverse frequencies, as HF's `ROPE_INIT_FUNCTIONS` compute them."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    scaling = dict(config.rope_scaling or ())
    if config.rope_type == "linear":
        return (inv_freq / scaling["factor"]).astype(np.float32)
    if config.rope_type != "llama3":
        return inv_freq.astype(np.float32)
    # HF `_compute_llama3_parameters`.
    factor, old_context_len = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, inv_freq_llama).astype(np.float32)


def rope_cos_sin(config: LlamaConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [..., head_dim] (HF layout: the half-dim frequencies repeated twice)."""
    freqs = positions[..., None].astype(jnp.float32) * rope_inv_freq(config)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [..., T, heads, D]; cos/sin: [..., T, D]. HF's rotate-half convention."""
    cos, sin = cos[..., None, :].astype(x.dtype), sin[..., None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)


def _linear(cfg: LlamaConfig, rngs: nnx.Rngs, n_in: int, n_out: int, bias: bool) -> nnx.Linear:
    return nnx.Linear(n_in, n_out, use_bias=bias, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs)


class LlamaAttention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        heads, kv_heads, d, bias = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.attention_bias
        self.q_proj = _linear(cfg, rngs, cfg.hidden_size, heads * d, bias)
        self.k_proj = _linear(cfg, rngs, cfg.hidden_size, kv_heads * d, bias)
        self.v_proj = _linear(cfg, rngs, cfg.hidden_size, kv_heads * d, bias)
        self.o_proj = _linear(cfg, rngs, heads * d, cfg.hidden_size, bias)
        self.shape = (heads, kv_heads, d)

    def qkv(self, x, cos, sin):
        """x: [..., T, hidden] -> q [..., T, H, D], k and v [..., T, H_kv, D], RoPE applied."""
        heads, kv_heads, d = self.shape
        q = self.q_proj(x).reshape(*x.shape[:-1], heads, d)
        k = self.k_proj(x).reshape(*x.shape[:-1], kv_heads, d)
        v = self.v_proj(x).reshape(*x.shape[:-1], kv_heads, d)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def paged(self, x, cos, sin, layer: int, metadata: AttentionMetadata, cache: KVCache, impl: str,
              visible: Visibility | None):
        """(attention output [T, hidden], the layer's new k and v [T, H_kv, D], cache).

        `visible` None: write the new K/V into the cache first, then read everything from it.
        Otherwise the cache is only read and the new K/V attend beside it (StepKV).
        """
        q, k, v = self.qkv(x, cos, sin)
        new = None
        if visible is None:
            cache = write_kv(cache, layer, k, v, metadata.slot_mapping)
        else:
            new = StepKV(k, v, visible)
        out = paged_attention(q, cache.k, cache.v, metadata, impl=impl, layer=layer, new=new)
        return self.o_proj(out.reshape(x.shape[0], -1)), k, v, cache

    def dense(self, x, cos, sin):
        """Full causal attention over x: [B, T, hidden]."""
        heads, kv_heads, d = self.shape
        q, k, v = self.qkv(x, cos, sin)
        b, t = x.shape[:2]
        q = q.reshape(b, t, kv_heads, heads // kv_heads, d)
        s = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) / math.sqrt(d)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e30)
        p = jax.nn.softmax(s, axis=-1)
        out = jnp.einsum("bkgqs,bskd->bqkgd", p, v.astype(jnp.float32)).astype(x.dtype)
        return self.o_proj(out.reshape(b, t, heads * d))


class LlamaMLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.gate_proj = _linear(cfg, rngs, cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.up_proj = _linear(cfg, rngs, cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.down_proj = _linear(cfg, rngs, cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.self_attn = LlamaAttention(cfg, rngs)
        self.mlp = LlamaMLP(cfg, rngs)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)

    def mlp_block(self, h):
        return h + self.mlp(self.post_attention_layernorm(h))


def _stacked_layers(cfg: LlamaConfig, rngs: nnx.Rngs) -> LlamaDecoderLayer:
    """One decoder layer whose every parameter has a leading [num_hidden_layers] axis."""
    @nnx.split_rngs(splits=cfg.num_hidden_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return LlamaDecoderLayer(cfg, rngs)
    return make(rngs)


def scan_layers(layers: LlamaDecoderLayer, body, carry):
    """`lax.scan` of body(carry, layer, index) -> (carry, y) over stacked `layers`.

    Layers must run in order (each reads the previous one's output), hence a scan rather
    than a vmap; the layer index lets the body address its layer of the KV pools.
    """
    graphdef, state = nnx.split(layers)
    num_layers = jax.tree.leaves(state)[0].shape[0]

    def step(carry, inputs):
        layer_state, index = inputs
        return body(carry, nnx.merge(graphdef, layer_state), index)

    return jax.lax.scan(step, carry, (state, jnp.arange(num_layers)))


class LlamaModel(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs)
        self.layers = _stacked_layers(cfg, rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)


class LlamaForCausalLM(nnx.Module):
    def __init__(self, config: LlamaConfig, rngs: nnx.Rngs):
        self.config = config
        self.model = LlamaModel(config, rngs)
        self.lm_head = None if config.tie_word_embeddings else _linear(config, rngs, config.hidden_size, config.vocab_size, False)

    def logits(self, h: jax.Array) -> jax.Array:
        h = self.model.norm(h)
        out = self.model.embed_tokens.attend(h) if self.lm_head is None else self.lm_head(h)
        return out.astype(jnp.float32)

    def paged(self, tokens, positions, metadata: AttentionMetadata, cache: KVCache, impl: str = "chunked",
              write: bool = False):
        """tokens, positions: [T]. Returns final hidden states [T, hidden], this step's K and V
        (each [L, T, H_kv, D]) and the cache.

        write=False: the cache is only read and comes back as it was; the caller writes the
        K/V (the engine, after its token-bucket switch). write=True: each layer writes its
        K/V and then reads them back through the cache, so XLA updates the donated pools in
        place with no write left to order after the last read.
        """
        cos, sin = rope_cos_sin(self.config, positions)
        visible = None if write else step_visibility(metadata, cache.block_size, cache.num_device_blocks)
        h = self.model.embed_tokens(tokens)

        def body(carry, layer, i):
            h, cache = carry
            attn, k, v, cache = layer.self_attn.paged(layer.input_layernorm(h), cos, sin, i, metadata, cache, impl,
                                                      visible)
            return (layer.mlp_block(h + attn), cache), (k, v)

        if write:
            # The cache rides in the carry: each layer's scatter updates the donated pools in place.
            (h, cache), (ks, vs) = scan_layers(self.model.layers, body, (h, cache))
            return h, ks, vs, cache

        def read_only(h, layer, i):
            # The pools enter the loop as constants: shared, never threaded through the carry.
            (h, _), kv = body((h, cache), layer, i)
            return h, kv

        h, (ks, vs) = scan_layers(self.model.layers, read_only, h)
        return h, ks, vs, cache

    def dense(self, tokens: jax.Array) -> jax.Array:
        """tokens: [B, T] -> logits [B, T, V], positions 0..T-1, causal, no cache."""
        cos, sin = rope_cos_sin(self.config, jnp.arange(tokens.shape[1]))
        h = self.model.embed_tokens(tokens)

        def body(h, layer, i):
            return layer.mlp_block(h + layer.self_attn.dense(layer.input_layernorm(h), cos, sin)), None

        h, _ = scan_layers(self.model.layers, body, h)
        return self.logits(h)


def paged_forward(graphdef, params, tokens, positions, metadata: AttentionMetadata, kv_cache: KVCache, impl: str = "chunked"):
    """One serving step: logits float32[num_sample, V] at metadata.logits_indices, new cache.

    tokens, positions: int32[T]. `graphdef, params = nnx.split(model)` once, outside; merged
    here, inside jit. `positions` feed RoPE and `metadata.positions` the causal mask: the same
    array for Llama, kept apart so position schemes (e.g. multimodal RoPE) can differ from
    cache order. Unjitted; `forward` is this function jitted with the cache donated.
    """
    model = nnx.merge(graphdef, params)
    hidden, _, _, kv_cache = model.paged(tokens, positions, metadata, kv_cache, impl, write=True)
    return model.logits(hidden[metadata.logits_indices]), kv_cache


def paged_forward_new_kv(graphdef, params, tokens, positions, metadata: AttentionMetadata, kv_cache: KVCache,
                         impl: str = "chunked"):
    """`paged_forward` that leaves the cache alone: (logits, (k, v)), this step's K/V [L, T, H_kv, D].

    The engine's forward: it writes the K/V itself, outside its token-bucket `lax.switch`,
    so the pools stay read-only inside the branches (see jaxsched.cache.attention).
    """
    model = nnx.merge(graphdef, params)
    hidden, k, v, _ = model.paged(tokens, positions, metadata, kv_cache, impl)
    return model.logits(hidden[metadata.logits_indices]), (k, v)


forward = jax.jit(paged_forward, static_argnames=("graphdef", "impl"), donate_argnames=("kv_cache",))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _dense(graphdef, params, tokens):
    return nnx.merge(graphdef, params).dense(tokens)


def dense_forward(model: LlamaForCausalLM, tokens: jax.Array) -> jax.Array:
    """Reference: logits float32[B, T, V] of full causal attention over tokens [B, T]."""
    graphdef, params = nnx.split(model)
    return _dense(graphdef, params, tokens)


# ----------------------------------------------------------------------------- HF weights

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry


class HFParam(NamedTuple):
    """Where one HF tensor lives in the model: the NNX parameter at `path`, transposed or not,
    and for a decoder layer's tensor its `layer` (index into the stacked parameter's axis 0)."""
    path: tuple
    shape: tuple[int, ...]       # the HF tensor's shape
    transposed: bool
    layer: int | None


def _is_stacked(path: tuple) -> bool:
    return path[:2] == ("model", "layers")


def hf_param_names(model: LlamaForCausalLM) -> dict[str, HFParam]:
    """HF name -> HFParam for every parameter of `model` (num_hidden_layers names per stacked one)."""
    names = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        leaf, shape = path[-1], tuple(var.get_value().shape)
        transposed = leaf == "kernel"
        hf_leaf = "bias" if leaf == "bias" else "weight"
        if _is_stacked(path):
            per_layer = shape[1:][::-1] if transposed else shape[1:]
            for i in range(shape[0]):
                name = ".".join(map(str, ("model", "layers", i) + path[2:-1] + (hf_leaf,)))
                names[name] = HFParam(path, per_layer, transposed, i)
        else:
            names[".".join(map(str, path[:-1] + (hf_leaf,)))] = HFParam(
                path, shape[::-1] if transposed else shape, transposed, None)
    return names


def to_hf_state_dict(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    """The model's parameters as HF-named host arrays (layers unstacked, kernels transposed)."""
    values = {path: np.asarray(var.get_value()) for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    out = {}
    for name, p in hf_param_names(model).items():
        value = values[p.path] if p.layer is None else values[p.path][p.layer]
        out[name] = value.T if p.transposed else value
    return out


def stack_hf_tensors(expected: dict[str, HFParam], state: dict, dtype) -> dict[tuple, tuple[Any, Any, list[str]]]:
    """NNX path -> (full shape, fill(index) -> np.ndarray of that index, the HF names it reads).

    `fill` builds any slice (a device's shard, or everything) straight from the HF tensors in
    `state`, read when it is called, stacking layers as it goes and casting only what it
    returns: no stacked copy of all the weights is ever made on the host. The slice comes
    in a 64-byte aligned array, which `jax.device_put` on CPU adopts without a copy.
    """
    by_path: dict[tuple, list] = {}
    for name, p in expected.items():
        by_path.setdefault(p.path, []).append((p, name))
    out = {}
    for path, entries in by_path.items():
        entries.sort(key=lambda e: -1 if e[0].layer is None else e[0].layer)
        names = [name for _, name in entries]
        transposed = entries[0][0].transposed
        host_shape = entries[0][0].shape[::-1] if transposed else entries[0][0].shape
        stacked = entries[0][0].layer is not None
        shape = ((len(names),) if stacked else ()) + tuple(host_shape)

        def host(name, transposed=transposed):
            array = np.asarray(state[name])      # a lazy tensor (GGUF) is read here
            return array.T if transposed else array  # a view: nothing copied yet

        def fill(index, names=names, shape=shape, stacked=stacked, host=host):
            index = tuple(index) + (slice(None),) * (len(shape) - len(index))
            part = aligned_empty(tuple(len(range(*s.indices(n))) for s, n in zip(index, shape)), dtype)
            if not stacked:
                part[...] = host(names[0])[index]
                return part
            for j, i in enumerate(range(shape[0])[index[0]]):
                part[j] = host(names[i])[index[1:]]
            return part
        out[path] = (shape, fill, names)
    return out


def check_hf_tensors(model: LlamaForCausalLM, state: dict[str, np.ndarray]) -> dict:
    """`hf_param_names(model)` after checking that `state` holds exactly those tensors.

    Raises ValueError naming every missing, unexpected and mis-shaped tensor. Ignored: rotary
    inv_freq buffers, and `lm_head.weight` when the embeddings are tied.
    """
    expected = hf_param_names(model)
    ignored = {n for n in state if n.endswith(_IGNORED_SUFFIXES)}
    if model.config.tie_word_embeddings:
        ignored.add("lm_head.weight")
    given = set(state) - ignored
    missing, extra = sorted(set(expected) - given), sorted(given - set(expected))
    misshaped = [f"{n}: got {tuple(np.shape(state[n]))}, want {expected[n][1]}"
                 for n in sorted(given & set(expected)) if tuple(np.shape(state[n])) != expected[n][1]]
    if missing or extra or misshaped:
        raise ValueError(f"HF state dict does not fit the model: missing={missing} "
                         f"unexpected={extra} misshaped={misshaped}")
    return expected


def load_hf_state_dict(model: LlamaForCausalLM, state: dict[str, np.ndarray], consume: bool = False) -> None:
    """Assign HF-named tensors to `model` in place (cast to the config dtype, layers stacked).

    consume=True deletes each tensor from `state` once it is placed, so the host copy of the
    weights shrinks as the device copy grows; with lazy tensors (`read_gguf(lazy=True)`) no
    host copy exists beyond the one being placed (the peak is about one copy, not two).
    Raises ValueError naming every missing, unexpected and mis-shaped tensor. Ignored: rotary
    inv_freq buffers, and `lm_head.weight` when the embeddings are tied.
    """
    expected = check_hf_tensors(model, state)
    dtype = jnp.dtype(model.config.dtype)
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    by_path = {path: var for path, var in flat}
    for path, (shape, fill, names) in stack_hf_tensors(expected, state, dtype).items():
        # device_put, not jnp.array: on CPU the filled host array becomes the parameter itself.
        by_path[path].set_value(jax.device_put(fill((slice(None),) * len(shape))))
        if consume:
            for name in names:
                del state[name]
    nnx.update(model, nnx.from_flat_state(flat))
