"""Host-side request types of the `LLM` front end, with vLLM's names."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

MAX_STOP_TOKEN_IDS = 8


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request (vLLM's names and defaults). `validate()` names bad fields."""
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: Optional[int] = None

    def validate(self, max_num_seqs: int, max_seqs_per_group: int) -> None:
        def bad(field, msg):
            raise ValueError(f"SamplingParams.{field}: {msg}")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.n > max_num_seqs:
            bad("n", f"{self.n} exceeds max_num_seqs={max_num_seqs}")
        if self.n > max_seqs_per_group:
            bad("n", f"{self.n} exceeds the engine's max_seqs_per_group={max_seqs_per_group}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k not in (-1, 0)):
            bad("top_k", f"must be -1 (off) or >= 1, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**31):
            bad("seed", f"must be an integer in [0, 2**31), got {self.seed!r}")
        if self.logprobs is not None and self.logprobs not in (0, 1):
            bad("logprobs", "only the sampled token's log-probability is returned: use 0 or 1")


@dataclasses.dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: Optional[str] = None
    finish_reason: Optional[str] = None     # "length", "stop", "ignored", "abort"
    logprobs: Optional[list[float]] = None
    cumulative_logprob: Optional[float] = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    message: Optional[str] = None            # why a request was ignored
