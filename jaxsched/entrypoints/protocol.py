"""Request bodies of the OpenAI API (the fields vLLM 0.5.3 reads), as pydantic models.

Field limits that need no engine are declared here, so pydantic's error names the field;
the engine's own limits (max_model_len, max_num_seqs) are checked by the server, and every
sampling field once more by `SamplingParams.validate`.
"""
from __future__ import annotations

from typing import Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from jaxsched.engine.params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str


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
            logprobs=logprobs)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    echo: bool = False


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True


def error_body(message: str, param: Optional[str] = None, kind: str = "BadRequestError",
               code: int = 400) -> dict:
    """OpenAI's error JSON (what the `openai` client turns into its exception's message)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code},
            "object": "error", "message": message, "type": kind, "param": param, "code": code}

