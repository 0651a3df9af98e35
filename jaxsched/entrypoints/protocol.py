"""Request bodies of the OpenAI API (the fields vLLM 0.5.3 reads), as pydantic models.

Field limits that need no engine are declared here, so pydantic's error names the field;
the engine's own limits (max_model_len, max_num_seqs) are checked by the server, and every
sampling field once more by `SamplingParams.validate`. vLLM's extra sampling fields are
here by its names. OpenAI fields that jaxsched does not implement (`suffix`,
`response_format` other than text, `tools`) are a 400 naming the field when they ask for
something, never silently ignored; unknown fields are ignored, as by OpenAI.
"""
from __future__ import annotations

from typing import Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from jaxsched.engine.params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatMessage(BaseModel):
    """A message; `content` a string or OpenAI's list of parts (text only: models.chat)."""
    model_config = ConfigDict(extra="allow")
    role: str
    content: Union[str, list[dict], None]           # required; null as OpenAI allows it


class _Sampling(BaseModel):
    """The fields completions and chat share; unknown fields are ignored, as by OpenAI."""
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = -1
    min_p: float = Field(default=0.0, ge=0, le=1)
    n: int = Field(default=1, ge=1)
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0, le=2)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    best_of: Optional[int] = Field(default=None, ge=1)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Optional[int] = Field(default=None, ge=1)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool = False
    logit_bias: Optional[dict[str, float]] = None

    def unsupported(self) -> Optional[str]:
        """The first field that asks for what jaxsched does not do, with why (a 400)."""
        return None

    def bias(self) -> Optional[dict[int, float]]:
        """logit_bias with OpenAI's string keys as token ids."""
        if not self.logit_bias:
            return None
        if not all(k.isdigit() for k in self.logit_bias):
            raise ValueError(f"logit_bias: keys must be token ids (digit strings), got "
                             f"{sorted(k for k in self.logit_bias if not k.isdigit())[:3]!r}")
        return {int(k): v for k, v in self.logit_bias.items()}

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling_params(self, max_tokens: int, logprobs: Optional[int]) -> SamplingParams:
        """vLLM's `to_sampling_params`: raises ValueError naming the field (a 400)."""
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop_token_ids=tuple(self.stop_token_ids), stop=self.stop_strings(),
            ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logprobs=logprobs, best_of=self.best_of,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            truncate_prompt_tokens=self.truncate_prompt_tokens, logit_bias=self.bias(),
            use_beam_search=self.use_beam_search,
            length_penalty=self.length_penalty, early_stopping=self.early_stopping)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: Optional[str] = None

    def unsupported(self) -> Optional[str]:
        if self.suffix:
            return "suffix: not supported (no insertion: the model continues the prompt)"
        if self.echo and self.logprobs is not None:
            return ("echo: with logprobs it needs the prompt's log-probabilities, which jaxsched "
                    "does not compute; send echo or logprobs")
        return super().unsupported()


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)   # OpenAI's newer max_tokens
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    response_format: Optional[dict] = None
    tools: Optional[list] = None

    def unsupported(self) -> Optional[str]:
        if self.response_format and self.response_format.get("type", "text") != "text":
            return (f"response_format: only {{'type': 'text'}} is supported (no guided decoding), "
                    f"got {self.response_format!r}")
        if self.tools:
            return "tools: not supported (no tool calling or parsing of tool calls)"
        return super().unsupported()


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the model's template."""
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model: Optional[str] = None
    tokens: list[int]


def error_body(message: str, param: Optional[str] = None, kind: str = "BadRequestError",
               code: int = 400) -> dict:
    """OpenAI's error JSON (what the `openai` client turns into its exception's message)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code},
            "object": "error", "message": message, "type": kind, "param": param, "code": code}

