"""Host-side request types of the `LLM` front end, with vLLM's names.

`SamplingParams` has every field of vLLM 0.5.3's, checks every field when it is built, as
vLLM's does, and raises one `ValueError` that names the field and its limit; `validate` with
an engine's limits adds those only it knows (`max_num_seqs`, `max_seqs_per_group`,
`max_model_len`, `vocab_size`). The fields of vLLM's that jaxsched does not implement (beam search, prompt
log-probabilities, Python logits processors) take their defaults only: any other value is
that one clear error, never silently ignored.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

MAX_STOP_TOKEN_IDS = 8
MAX_LOGIT_BIAS = 300       # OpenAI's limit on logit_bias entries: a compiled width of the step
NO_TOKEN = 2**31 - 1       # pads token-id columns: past any vocabulary, so scatters drop it
MAX_LOGPROBS = 20          # vLLM's default max_logprobs: a compiled width of the step's output
MAX_SEED = 2**31


def _bad(field: str, msg: str):
    raise ValueError(f"SamplingParams.{field}: {msg}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# vLLM fields that jaxsched accepts at their default only, and why it has no other.
UNSUPPORTED = {
    "use_beam_search": (False, "beam search is not implemented (later vLLMs dropped it too)"),
    "length_penalty": (1.0, "it only applies to beam search, which is not implemented"),
    "early_stopping": (False, "it only applies to beam search, which is not implemented"),
    "prompt_logprobs": (None, "the model computes logits at a prompt's last position only"),
    "logits_processors": (None, "a Python callable cannot run inside the compiled step; "
                                "use the penalties, min_p, stop_token_ids or min_tokens"),
}


def truncate_prompt(ids: list[int], keep: Optional[int]) -> list[int]:
    """truncate_prompt_tokens: a prompt's last `keep` tokens (vLLM truncates on the left)."""
    return ids[-keep:] if keep else ids


def _is_default(value, default) -> bool:
    if default is None:
        return value is None or (isinstance(value, (list, tuple)) and not value)
    if isinstance(default, bool):
        return value is default
    return _is_number(value) and value == default


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request (vLLM 0.5.3's names and defaults); checked when built.

    `best_of` sequences are sampled and the `n` with the highest cumulative log-probability
    returned (default: `n`). `include_stop_str_in_output` keeps the stop string, or a stop
    token's text, at the end of the text. `skip_special_tokens` leaves special tokens out of
    the text; `spaces_between_special_tokens` is vLLM's, and as in vLLM it changes nothing for
    the fast tokenizers jaxsched uses. `detokenize=False` leaves `text` empty (token ids only).
    `truncate_prompt_tokens=k` keeps a prompt's last k tokens. `logit_bias` ({token id: bias
    in [-100, 100]}, as OpenAI's and later vLLMs') is added to those logits before anything
    else, on device.
    """
    n: int = 1
    best_of: Optional[int] = None
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
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    truncate_prompt_tokens: Optional[int] = None
    logit_bias: Optional[dict[int, float]] = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool = False
    prompt_logprobs: Optional[int] = None
    logits_processors: Optional[list] = None

    def __post_init__(self):
        if self.best_of is None:                 # vLLM's default: as many as returned
            self.best_of = self.n
        if isinstance(self.stop_token_ids, list):
            self.stop_token_ids = tuple(self.stop_token_ids)
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        elif isinstance(self.stop, list):
            self.stop = tuple(self.stop)
        self.validate()

    def validate(self, max_num_seqs: Optional[int] = None, max_seqs_per_group: Optional[int] = None,
                 max_model_len: Optional[int] = None, vocab_size: Optional[int] = None) -> None:
        """Every field's own limits, then the engine's where they are given."""
        if not _is_int(self.n) or self.n < 1:
            _bad("n", f"must be an integer >= 1, got {self.n!r}")
        if not _is_int(self.best_of) or self.best_of < self.n:
            _bad("best_of", f"must be an integer >= n={self.n} (or None: n), got {self.best_of!r}")
        for name, (default, why) in UNSUPPORTED.items():
            if not _is_default(getattr(self, name), default):
                _bad(name, f"only {default!r} is supported, got {getattr(self, name)!r}: {why}")
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
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                _bad(name, f"must be True or False, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            _bad("stop", "stop strings need the text: set detokenize=True or use stop_token_ids")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or any(
                    not _is_int(t) or t < 0 or not _is_number(b) or not -100 <= b <= 100
                    for t, b in self.logit_bias.items()):
                _bad("logit_bias", f"must be a dict of token ids >= 0 to numbers in [-100, 100], "
                     f"got {self.logit_bias!r}")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                _bad("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        if self.truncate_prompt_tokens is not None and (
                not _is_int(self.truncate_prompt_tokens) or self.truncate_prompt_tokens < 1):
            _bad("truncate_prompt_tokens", f"must be None or an integer >= 1, "
                 f"got {self.truncate_prompt_tokens!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            _bad("logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}] (the sampled token's "
                 f"log-probability and that many top ones), got {self.logprobs!r}")
        # The engine samples best_of sequences: the limits bound those.
        field = "n" if self.best_of == self.n else "best_of"
        if max_num_seqs is not None and self.best_of > max_num_seqs:
            _bad(field, f"{self.best_of} exceeds max_num_seqs={max_num_seqs}")
        if max_seqs_per_group is not None and self.best_of > max_seqs_per_group:
            _bad(field, f"{self.best_of} exceeds the engine's max_seqs_per_group={max_seqs_per_group} "
                 f"(raise it with LLM(max_seqs_per_group=...))")
        if vocab_size is not None and self.logit_bias and max(self.logit_bias) >= vocab_size:
            _bad("logit_bias", f"token ids must be in [0, vocab_size={vocab_size}), got {max(self.logit_bias)}")
        if max_model_len is not None and self.max_tokens > max_model_len:
            _bad("max_tokens", f"{self.max_tokens} exceeds max_model_len={max_model_len}")


@dataclasses.dataclass
class Logprob:
    """One token's log-probability (vLLM's): `rank` is its place among the vocabulary's most
    likely (1 = the most), None for a sampled token outside the `logprobs` most likely (the
    step ranks only those); `decoded_token` its text, None without detokenize."""
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclasses.dataclass
class CompletionOutput:
    """One sequence of a request (vLLM's fields). `index` is the sequence's among the request's
    `best_of`; `logprobs`, with `SamplingParams.logprobs=k`, has one dict per token: the
    sampled token's `Logprob`, then the k most likely tokens', by token id; `stop_reason` is the
    stop string or stop token id it stopped at (None at EOS or any other finish)."""
    index: int
    token_ids: list[int]
    text: str = ""
    finish_reason: Optional[str] = None     # "length", "stop", "ignored", "abort"
    logprobs: Optional[list[dict[int, Logprob]]] = None
    cumulative_logprob: Optional[float] = None
    stop_reason: Union[int, str, None] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """When a request's events happened (vLLM's fields; `time.time()` seconds). The request
    arrives when it is added, is first scheduled at the start of the first engine step that
    runs any of it (None while it waits, or if it never ran), and gets its first and latest
    tokens and its finish when the steps that made them return."""
    arrival_time: float
    last_token_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    time_in_queue: Optional[float] = None
    finished_time: Optional[float] = None


@dataclasses.dataclass
class RequestOutput:
    """A request's outputs so far (vLLM's fields): its best `n` sequences, best first when
    `best_of` > n, and its `metrics`. `prompt_logprobs` is always None (not computed);
    `message` (jaxsched's) says why a request was ignored."""
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    message: Optional[str] = None
    prompt_logprobs: None = None
    metrics: Optional[RequestMetrics] = None
