"""Host-side request types of the `LLM` front end, with vLLM's names.

`SamplingParams` checks every field when it is built, as vLLM's does, and raises one
`ValueError` that names the field and its limit; `check_engine_limits` adds the limits that
only an engine knows (`max_num_seqs`, `max_seqs_per_group`, `max_model_len`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

MAX_STOP_TOKEN_IDS = 8
MAX_LOGPROBS = 20          # vLLM's default max_logprobs: a compiled width of the step's output
MAX_SEED = 2**31


def _bad(field: str, msg: str):
    raise ValueError(f"SamplingParams.{field}: {msg}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request (vLLM's names and defaults); checked when built."""
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()              # stop strings, matched on the host in the text
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: Optional[int] = None

    def __post_init__(self):
        if isinstance(self.stop_token_ids, list):
            self.stop_token_ids = tuple(self.stop_token_ids)
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        elif isinstance(self.stop, list):
            self.stop = tuple(self.stop)
        self.validate()

    def validate(self, max_num_seqs: Optional[int] = None, max_seqs_per_group: Optional[int] = None,
                 max_model_len: Optional[int] = None) -> None:
        """Every field's own limits, then the engine's where they are given."""
        if not _is_int(self.n) or self.n < 1:
            _bad("n", f"must be an integer >= 1, got {self.n!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            _bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            _bad("top_p", f"must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (-1, 0)):
            _bad("top_k", f"must be -1 or 0 (off) or an integer >= 1, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            _bad("min_p", f"must be a number in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            _bad("seed", f"must be None or an integer in [0, 2**31), got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            _bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            _bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}], "
                 f"got {self.min_tokens!r}")
        if not isinstance(self.stop_token_ids, tuple) or any(
                not _is_int(t) or t < 0 for t in self.stop_token_ids):
            _bad("stop_token_ids", f"must be a list of integers >= 0, got {self.stop_token_ids!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            _bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if not isinstance(self.stop, tuple) or any(not isinstance(x, str) or not x for x in self.stop):
            _bad("stop", f"must be a string or a list of non-empty strings, got {self.stop!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                _bad(name, f"must be a number in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 2:
            _bad("repetition_penalty", f"must be a number in (0, 2], got {self.repetition_penalty!r}")
        if not isinstance(self.ignore_eos, bool):
            _bad("ignore_eos", f"must be True or False, got {self.ignore_eos!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            _bad("logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}] (the sampled token's "
                 f"log-probability and that many top ones), got {self.logprobs!r}")
        if max_num_seqs is not None and self.n > max_num_seqs:
            _bad("n", f"{self.n} exceeds max_num_seqs={max_num_seqs}")
        if max_seqs_per_group is not None and self.n > max_seqs_per_group:
            _bad("n", f"{self.n} exceeds the engine's max_seqs_per_group={max_seqs_per_group} "
                 f"(raise it with LLM(max_seqs_per_group=...))")
        if max_model_len is not None and self.max_tokens > max_model_len:
            _bad("max_tokens", f"{self.max_tokens} exceeds max_model_len={max_model_len}")


@dataclasses.dataclass
class CompletionOutput:
    """One sequence of a request (vLLM's fields)."""
    index: int
    token_ids: list[int]
    text: Optional[str] = None
    finish_reason: Optional[str] = None     # "length", "stop", "ignored", "abort"
    logprobs: Optional[list[float]] = None
    cumulative_logprob: Optional[float] = None
    top_logprobs: Optional[list[dict[int, float]]] = None   # per token: the `logprobs` most likely


@dataclasses.dataclass
class RequestOutput:
    """A request's outputs so far (vLLM's fields); `message` says why a request was ignored."""
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    message: Optional[str] = None
