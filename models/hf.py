"""Reading a Hugging Face Llama/Mistral checkpoint directory with numpy only (no torch).

`read_hf_checkpoint(path)` returns `(hf_config, tensors)`: the parsed ``config.json`` (with the
defaults that ``LlamaConfig`` would fill in made explicit: ``num_key_value_heads``, ``head_dim``,
``rope_theta``, ``rms_norm_eps``, ``tie_word_embeddings``, ...) and every tensor of the
``*.safetensors`` file(s) under its Hugging Face name, checked against the config.

bf16 weights load as ``ml_dtypes.bfloat16`` arrays (numpy has no bf16 of its own) unless a
``dtype`` is asked for.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import struct
from typing import Any

import numpy as np

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_MODEL_TYPES",
    "read_hf_checkpoint",
    "read_hf_config",
    "normalize_hf_config",
    "expected_llama_shapes",
    "check_llama_tensors",
]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
SUPPORTED_MODEL_TYPES = ("llama", "mistral")

_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# Buffers some old checkpoints carry that are recomputed, never loaded.
_IGNORED_TENSOR = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def _bfloat16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def read_hf_config(path) -> dict[str, Any]:
    """Parse, validate and normalize ``<path>/config.json``."""
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint directory not found: {path}")
    if not path.is_dir():
        raise FileNotFoundError(f"Checkpoint path {path} is not a directory (expected a folder with config.json)")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"No config.json in checkpoint directory {path}")
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path} must hold a JSON object, not {type(raw).__name__}")
    return normalize_hf_config(raw, source=str(config_path))


def normalize_hf_config(raw: dict[str, Any], source: str = "config") -> dict[str, Any]:
    """Validate a Llama/Mistral ``config.json`` dict and fill in ``LlamaConfig``'s defaults."""
    cfg = dict(raw)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{source}: unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    archs = cfg.get("architectures")
    if archs is not None:
        if isinstance(archs, str):
            archs = [archs]
        bad = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
        if bad or not archs:
            raise ValueError(
                f"{source}: unsupported architectures {archs!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
    if cfg.get("sliding_window") is not None and cfg.get("use_sliding_window", True) is not False:
        raise ValueError(
            f"{source}: sliding_window={cfg['sliding_window']!r} is set; sliding-window attention is not supported "
            "(only Mistral checkpoints with sliding_window null load)"
        )
    missing = [k for k in _REQUIRED_FIELDS if cfg.get(k) is None]
    if missing:
        raise ValueError(f"{source}: missing required field(s) {', '.join(missing)}")
    for k in _REQUIRED_FIELDS:
        if not isinstance(cfg[k], int) or isinstance(cfg[k], bool) or cfg[k] <= 0:
            raise ValueError(f"{source}: field {k} must be a positive integer, got {cfg[k]!r}")

    n_head = cfg["num_attention_heads"]
    if cfg.get("num_key_value_heads") is None:
        cfg["num_key_value_heads"] = n_head
    n_kv = cfg["num_key_value_heads"]
    if n_head % n_kv:
        raise ValueError(
            f"{source}: num_attention_heads={n_head} is not a multiple of num_key_value_heads={n_kv}"
        )
    if cfg.get("head_dim") is None:
        if cfg["hidden_size"] % n_head:
            raise ValueError(
                f"{source}: hidden_size={cfg['hidden_size']} is not divisible by num_attention_heads={n_head} "
                "and no head_dim is given"
            )
        cfg["head_dim"] = cfg["hidden_size"] // n_head

    rope_params = cfg.get("rope_parameters")
    if cfg.get("rope_theta") is None:
        theta = rope_params.get("rope_theta") if isinstance(rope_params, dict) else None
        cfg["rope_theta"] = float(theta) if theta is not None else 10000.0
    if cfg.get("rope_scaling") is None and isinstance(rope_params, dict):
        if rope_params.get("rope_type", "default") != "default":
            cfg["rope_scaling"] = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    cfg.setdefault("rope_scaling", None)
    if cfg.get("rms_norm_eps") is None:
        cfg["rms_norm_eps"] = 1e-6 if model_type == "llama" else 1e-5
    if cfg.get("max_position_embeddings") is None:
        cfg["max_position_embeddings"] = 2048 if model_type == "llama" else 4096 * 32
    if cfg.get("tie_word_embeddings") is None:
        cfg["tie_word_embeddings"] = False
    cfg.setdefault("hidden_act", "silu")
    cfg.setdefault("attention_bias", False)
    cfg.setdefault("mlp_bias", False)
    if cfg["hidden_act"] != "silu":
        raise ValueError(f"{source}: hidden_act={cfg['hidden_act']!r} is not supported (only 'silu')")
    return cfg


def expected_llama_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The HF ``LlamaForCausalLM`` state-dict names and shapes that ``cfg`` implies
    (``lm_head.weight`` only when embeddings are not tied)."""
    h, v, i = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
        if cfg.get("attention_bias"):
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (q,),
                    p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,),
                    p + "self_attn.o_proj.bias": (h,),
                }
            )
        if cfg.get("mlp_bias"):
            shapes.update(
                {p + "mlp.gate_proj.bias": (i,), p + "mlp.up_proj.bias": (i,), p + "mlp.down_proj.bias": (h,)}
            )
    return shapes


_SHAPE_FIELDS = {
    "model.embed_tokens.weight": "(vocab_size, hidden_size)",
    "lm_head.weight": "(vocab_size, hidden_size)",
    "q_proj.weight": "(num_attention_heads * head_dim, hidden_size)",
    "k_proj.weight": "(num_key_value_heads * head_dim, hidden_size)",
    "v_proj.weight": "(num_key_value_heads * head_dim, hidden_size)",
    "o_proj.weight": "(hidden_size, num_attention_heads * head_dim)",
    "gate_proj.weight": "(intermediate_size, hidden_size)",
    "up_proj.weight": "(intermediate_size, hidden_size)",
    "down_proj.weight": "(hidden_size, intermediate_size)",
    "norm.weight": "(hidden_size,)",
    "layernorm.weight": "(hidden_size,)",
}


def _shape_fields(name: str) -> str:
    for suffix, fields in _SHAPE_FIELDS.items():
        if name.endswith(suffix):
            return f" = {fields}"
    return ""


def check_llama_tensors(cfg: dict[str, Any], tensors: dict[str, np.ndarray], source: str = "checkpoint") -> None:
    """``ValueError`` unless ``tensors`` are exactly the ones ``cfg`` implies, with the right shapes.

    A tied checkpoint may still carry ``lm_head.weight`` (it must then have the embedding shape).
    """
    expected = expected_llama_shapes(cfg)
    # Check the embedding first: a wrong hidden_size/vocab_size shows up there most readably.
    order = ["model.embed_tokens.weight"] + [k for k in expected if k != "model.embed_tokens.weight"]
    for name in order:
        if name in tensors and tuple(tensors[name].shape) != expected[name]:
            raise ValueError(
                f"{source}: tensor {name!r} has shape {tuple(tensors[name].shape)}, but config.json implies "
                f"{expected[name]}{_shape_fields(name)}"
            )
    missing = [k for k in order if k not in tensors]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"{source}: missing tensor(s) {', '.join(missing[:5])}{more}")
    extra = sorted(k for k in tensors if k not in expected)
    if cfg["tie_word_embeddings"] and "lm_head.weight" in extra:
        extra.remove("lm_head.weight")
        want = expected["model.embed_tokens.weight"]
        if tuple(tensors["lm_head.weight"].shape) != want:
            raise ValueError(
                f"{source}: tensor 'lm_head.weight' has shape {tuple(tensors['lm_head.weight'].shape)}, but "
                f"config.json implies {want} = (vocab_size, hidden_size)"
            )
    if extra:
        more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
        raise ValueError(
            f"{source}: unexpected tensor(s) {', '.join(extra[:5])}{more} for a "
            f"{cfg['num_hidden_layers']}-layer Llama config"
        )


# --------------------------------------------------------------------------------------------
# safetensors
# --------------------------------------------------------------------------------------------

_RAW_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def _read_safetensors_raw(file: pathlib.Path, names) -> dict[str, np.ndarray]:
    """Minimal reader of the safetensors format (8-byte header length, JSON header, raw data), for
    dtypes the installed ``safetensors`` cannot hand to numpy (bf16 on old versions)."""
    with open(file, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    out = {}
    for name in names:
        info = header[name]
        dt = info["dtype"]
        dtype = _bfloat16() if dt == "BF16" else np.dtype(_RAW_DTYPES[dt]) if dt in _RAW_DTYPES else None
        if dtype is None:
            raise ValueError(f"{file}: tensor {name!r} has dtype {dt}, which cannot be read")
        start, end = info["data_offsets"]
        count = int(np.prod(info["shape"], dtype=np.int64))
        arr = np.fromfile(file, dtype=dtype, count=count, offset=8 + n + start)
        if arr.nbytes != end - start:
            raise ValueError(f"{file}: tensor {name!r} is truncated")
        out[name] = arr.reshape(info["shape"])
    return out


def _load_safetensors(file: pathlib.Path, names=None) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    try:  # registers numpy's "bfloat16" dtype name, which safetensors' numpy backend looks up
        import ml_dtypes  # noqa: F401
    except ImportError:  # pragma: no cover - then bf16 goes through the raw reader (which needs it too)
        pass
    out: dict[str, np.ndarray] = {}
    fallback = []
    try:
        with safe_open(os.fspath(file), framework="np") as f:
            keys = list(f.keys()) if names is None else list(names)
            available = set(f.keys())
            for name in keys:
                if name not in available:
                    raise ValueError(f"{file}: tensor {name!r} listed in the index is not in the file")
                try:
                    out[name] = f.get_tensor(name)
                except (TypeError, ValueError, KeyError) as exc:  # e.g. bf16 with an old safetensors
                    msg = str(exc).lower()
                    if not any(w in msg for w in ("dtype", "data type", "bf16", "bfloat16")):
                        raise
                    fallback.append(name)
    except ValueError:
        raise
    except Exception as exc:  # SafetensorError for corrupt files
        raise ValueError(f"{file} is not a readable safetensors file: {exc}") from exc
    if fallback:
        out.update(_read_safetensors_raw(file, fallback))
    return out


def _weight_files(path: pathlib.Path) -> dict[pathlib.Path, list[str] | None]:
    """``{file: names or None (all)}`` for the checkpoint's safetensors files."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {exc}") from exc
        files: dict[pathlib.Path, list[str] | None] = {}
        for name, fname in weight_map.items():
            files.setdefault(path / fname, []).append(name)
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"Shard {file.name} listed in {index.name} is missing from {path}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return {single: None}
    found = sorted(path.glob("*.safetensors"))
    if not found:
        extra = ""
        if list(path.glob("*.bin")) or list(path.glob("*.pt")) or list(path.glob("*.pth")):
            extra = " (only PyTorch .bin/.pt weights are present: convert them to safetensors)"
        raise FileNotFoundError(f"No *.safetensors weights in checkpoint directory {path}{extra}")
    return {f: None for f in found}


def read_hf_checkpoint(path, dtype=None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read a Hugging Face Llama/Mistral checkpoint directory: ``(hf_config, tensors)``.

    ``path`` holds ``config.json`` and ``model.safetensors``, or shards listed in
    ``model.safetensors.index.json`` (or, without an index, every ``*.safetensors``).
    ``dtype`` (e.g. ``np.float32``) converts every tensor; ``None`` keeps the stored dtype
    (bf16 -> ``ml_dtypes.bfloat16``).

    Raises ``FileNotFoundError`` for a missing directory/config/weights and ``ValueError`` for an
    unsupported architecture or a config that disagrees with the tensors (naming the tensor, the
    expected and the actual shape).
    """
    path = pathlib.Path(path)
    cfg = read_hf_config(path)
    tensors: dict[str, np.ndarray] = {}
    for file, names in _weight_files(path).items():
        for name, arr in _load_safetensors(file, names).items():
            if _IGNORED_TENSOR.search(name):
                continue
            if name in tensors:
                raise ValueError(f"{path}: tensor {name!r} appears in more than one weights file")
            tensors[name] = arr
    check_llama_tensors(cfg, tensors, source=str(path))
    if dtype is not None:
        dtype = np.dtype(dtype)
        tensors = {k: (v if v.dtype == dtype else v.astype(dtype)) for k, v in tensors.items()}
    return cfg, tensors
