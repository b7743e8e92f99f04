"""OpenAI request bodies rayattn accepts. Unknown fields are rejected (400 naming the field)
rather than silently ignored, and known-but-unsupported ones get a 400 that says so."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_INT32 = 2**31 - 1


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=_INT32)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    n: int = Field(1, ge=1, le=1, description="only n=1 is supported")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    """vLLM extension: keep generating past EOS (benchmarks use it to fix output lengths)."""
    return_token_ids: bool | None = None
    """vLLM extension: non-streaming choices also carry `prompt_token_ids` and `token_ids`."""
    # Accepted for client compatibility, only at their neutral values.
    logprobs: Literal[False] | None = None
    echo: Literal[False] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_limit(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    def sampling_kwargs(self, max_tokens: int) -> dict[str, Any]:
        kw: dict[str, Any] = dict(max_tokens=max_tokens, temperature=self.temperature,
                                  top_p=self.top_p, presence_penalty=self.presence_penalty,
                                  frequency_penalty=self.frequency_penalty, seed=self.seed,
                                  ignore_eos=self.ignore_eos)
        if self.stop:
            kw["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        return kw


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=_INT32)

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int | None = Field(16, ge=1, le=_INT32)

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens


UNSUPPORTED = {"tools", "tool_choice", "functions", "function_call", "response_format",
               "logit_bias", "top_logprobs", "best_of", "suffix", "parallel_tool_calls"}
