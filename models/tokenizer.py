"""Tokenizers for the Llama family, built on the `tokenizers` package (no transformers needed).

* ``Tokenizer.from_gguf(metadata)`` rebuilds a byte-level BPE tokenizer from GGUF metadata
  (``tokenizer.ggml.*``, as returned by ``models.gguf.read_gguf``), like llama.cpp does;
* ``Tokenizer.from_hf_dir(path)`` loads ``tokenizer.json`` (+ ``tokenizer_config.json``);
* ``IncrementalDetokenizer`` turns a stream of generated ids into text pieces that never end in
  a broken UTF-8 fragment, and whose concatenation equals ``decode(all_ids)``.
"""

from __future__ import annotations

import json
import pathlib
import warnings
from typing import Any, Iterable, Sequence

__all__ = ["Tokenizer", "IncrementalDetokenizer", "GGUF_TOKEN_TYPE_CONTROL", "GGUF_TOKEN_TYPE_USER_DEFINED"]

# llama.cpp's `enum llama_token_type` values stored in tokenizer.ggml.token_type.
GGUF_TOKEN_TYPE_NORMAL = 1
GGUF_TOKEN_TYPE_UNKNOWN = 2
GGUF_TOKEN_TYPE_CONTROL = 3
GGUF_TOKEN_TYPE_USER_DEFINED = 4
GGUF_TOKEN_TYPE_UNUSED = 5
GGUF_TOKEN_TYPE_BYTE = 6

_REPLACEMENT = "\ufffd"

# Pre-tokenizer regexes of llama.cpp (llama-vocab.cpp) by `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-2 regex with every digit split off first (SmolLM, StarCoder, ...).
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_GPT2 = {None, "default", "gpt2", "gpt-2", "mpt", "olmo", "jais"}
_LLAMA3 = {"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"}
_QWEN2 = {"qwen2", "deepseek-r1-qwen", "megrez"}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _byte_level_pre_tokenizer(pre: str | None, add_prefix_space: bool):
    from tokenizers import Regex, pre_tokenizers

    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True),
            ]
        )
    if pre in _LLAMA3 or pre in _QWEN2:
        split = _LLAMA3_SPLIT if pre in _LLAMA3 else _QWEN2_SPLIT
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
            ]
        )
    if pre not in _GPT2:
        warnings.warn(
            f"GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not known here; using GPT-2's byte-level "
            "split, which may tokenize some text differently from llama.cpp",
            stacklevel=3,
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)


def _token_content(tok: Any) -> str | None:
    if tok is None:
        return None
    if isinstance(tok, dict):
        return tok.get("content")
    return str(tok)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the bits a serving engine needs (special ids, chat template).

    ``encode(text, add_special_tokens=True)`` adds BOS/EOS only when the model asks for it
    (GGUF ``tokenizer.ggml.add_bos_token`` / the ``tokenizer.json`` post-processor); special
    tokens written in the text (``<|im_start|>``) are always matched as single tokens.
    """

    def __init__(
        self,
        backend,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        chat_template: str | None = None,
    ):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.chat_template = chat_template

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any]) -> "Tokenizer":
        """Build the tokenizer a GGUF file describes (``metadata`` as from ``read_gguf``).

        Only byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``: SmolLM, Llama 3,
        Qwen2, StarCoder, ...) are supported. Tokens typed CONTROL become special tokens and
        USER_DEFINED ones plain added tokens, so both are matched whole in the text.
        """
        from tokenizers import AddedToken, decoders, models, processors
        from tokenizers import Tokenizer as _Backend

        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(
                f"Unsupported GGUF tokenizer model {model!r} (tokenizer.ggml.model): only byte-level BPE "
                "('gpt2') is supported"
            )
        tokens = metadata.get("tokenizer.ggml.tokens")
        merges = metadata.get("tokenizer.ggml.merges")
        if not tokens:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
        if merges is None:
            raise ValueError("GGUF metadata has no tokenizer.ggml.merges (needed for a BPE tokenizer)")
        token_types = metadata.get("tokenizer.ggml.token_type") or [GGUF_TOKEN_TYPE_NORMAL] * len(tokens)

        # Tokens are stored in GPT-2's byte alphabet; respell any that are not (llama.cpp tolerates it).
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab: dict[str, int] = {}
        for index, token in enumerate(tokens):
            key = token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))
            vocab.setdefault(key, index)
        merge_pairs = []
        for m in merges:
            a, sep, b = m.partition(" ")
            if not sep:
                raise ValueError(f"GGUF merge {m!r} (tokenizer.ggml.merges) is not 'left right'")
            merge_pairs.append((a, b))

        backend = _Backend(
            models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False, byte_fallback=False, ignore_merges=False)
        )
        add_prefix_space = bool(metadata.get("tokenizer.ggml.add_space_prefix", False))
        backend.pre_tokenizer = _byte_level_pre_tokenizer(metadata.get("tokenizer.ggml.pre"), add_prefix_space)
        backend.decoder = decoders.ByteLevel()

        control, user = [], []
        for token, ttype in zip(tokens, token_types):
            if vocab.get(token) is None:
                continue  # not spelled in the byte alphabet: would get a new id, never matchable as is
            if ttype == GGUF_TOKEN_TYPE_CONTROL:
                control.append(AddedToken(token, special=True, normalized=False))
            elif ttype == GGUF_TOKEN_TYPE_USER_DEFINED:
                user.append(AddedToken(token, special=False, normalized=False))
        if control:
            backend.add_special_tokens(control)
        if user:
            backend.add_tokens(user)

        def tid(key):
            v = metadata.get(f"tokenizer.ggml.{key}")
            return int(v) if v is not None else None

        bos, eos = tid("bos_token_id"), tid("eos_token_id")
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        pre = [tokens[bos]] if add_bos and bos is not None else []
        post = [tokens[eos]] if add_eos and eos is not None else []
        if pre or post:
            specials = dict([(tokens[bos], bos)] if pre else [])
            specials.update([(tokens[eos], eos)] if post else [])
            backend.post_processor = processors.TemplateProcessing(
                single=pre + ["$A"] + post,
                pair=pre + ["$A"] + post + pre + ["$B:1"] + post,
                special_tokens=list(specials.items()),
            )
        else:
            backend.post_processor = processors.ByteLevel(trim_offsets=False)

        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=tid("padding_token_id"),
            unk_token_id=tid("unknown_token_id"),
            chat_template=metadata.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_gguf_file(cls, path) -> "Tokenizer":
        """``from_gguf`` on the metadata of a GGUF file (no tensor is dequantized)."""
        from .gguf import read_gguf_metadata

        return cls.from_gguf(read_gguf_metadata(path))

    @classmethod
    def from_hf_dir(cls, path) -> "Tokenizer":
        """Load ``<path>/tokenizer.json``; the chat template and BOS/EOS tokens come from
        ``tokenizer_config.json`` (or ``chat_template.jinja`` / ``chat_template.json``), with
        ``config.json`` / ``generation_config.json`` ids as fallbacks."""
        from tokenizers import Tokenizer as _Backend

        path = pathlib.Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"Tokenizer directory not found: {path}")
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"No tokenizer.json in {path} (only fast-tokenizer files are supported)")
        backend = _Backend.from_file(str(tj))

        def load(name) -> dict:
            p = path / name
            if not p.is_file():
                return {}
            try:
                data = json.loads(p.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{p} is not valid JSON: {exc}") from exc
            return data if isinstance(data, dict) else {}

        tcfg = load("tokenizer_config.json")
        chat_template = tcfg.get("chat_template")
        if chat_template is None and (path / "chat_template.jinja").is_file():
            chat_template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        if chat_template is None:
            chat_template = load("chat_template.json").get("chat_template")
        if isinstance(chat_template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)}
            chat_template = named.get("default") or next(iter(named.values()), None)

        def token_id(name):
            content = _token_content(tcfg.get(name))
            return backend.token_to_id(content) if content is not None else None

        def fallback(key):
            for fname in ("generation_config.json", "config.json"):
                v = load(fname).get(key)
                if isinstance(v, list):
                    v = v[0] if v else None
                if v is not None:
                    return int(v)
            return None

        bos = token_id("bos_token")
        eos = token_id("eos_token")
        return cls(
            backend,
            bos_token_id=bos if bos is not None else fallback("bos_token_id"),
            eos_token_id=eos if eos is not None else fallback("eos_token_id"),
            pad_token_id=token_id("pad_token") if token_id("pad_token") is not None else fallback("pad_token_id"),
            unk_token_id=token_id("unk_token"),
            chat_template=chat_template,
        )

    # ---------------------------------------------------------------- use

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_id) if self.eos_token_id is not None else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [list(e.ids) for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = False,
                            chat_template: str | None = None, **kwargs):
        """Render ``messages`` with ``chat_template`` or this tokenizer's own (see
        ``models.chat.render_chat``); ``tokenize=True`` returns ids (no BOS added: templates
        write their own special tokens)."""
        from .chat import render_chat

        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("This tokenizer has no chat_template")
        special = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        special.update(kwargs)
        text = render_chat(template, messages, add_generation_prompt=add_generation_prompt, **special)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def detokenizer(self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = False) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, prompt_ids=prompt_ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Per-sequence streaming detokenizer.

    ``step(new_ids)`` returns the text that the new ids complete -- possibly ``""`` -- and never
    text ending in U+FFFD: while the decoded tail ends in a replacement character (a UTF-8
    sequence cut between tokens, e.g. an emoji spread over several byte tokens) it is held back.
    ``flush()`` returns whatever is still held (at the end of a sequence). Without prompt ids,
    ``"".join(step outputs) + flush() == tokenizer.decode(all_ids)``.

    It decodes a short window of ids (from ``prefix_offset``) twice and emits the difference, so
    tokenizers whose decoders depend on the previous token (SentencePiece's leading space) stream
    correctly too.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = [int(i) for i in prompt_ids]
        # Window of context: a few prompt tokens so the first generated token decodes in context.
        self.read_offset = len(self.ids)
        self.prefix_offset = max(len(self.ids) - 5, 0)

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, new_ids: int | Iterable[int]) -> str:
        if isinstance(new_ids, int):
            new_ids = [new_ids]
        self.ids.extend(int(i) for i in new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            out = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return out
        return ""

    def flush(self) -> str:
        """The held-back tail (may contain U+FFFD if the sequence really ends mid-character)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :]

    @property
    def pending(self) -> bool:
        """Whether some ids have not been turned into text yet."""
        return self.read_offset < len(self.ids)
