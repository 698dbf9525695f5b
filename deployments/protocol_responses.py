"""OpenAI API response models, as radixserve's HTTP server writes them (the requests'
models: deployments/protocol.py). Unknown fields are refused: a typo is a bug of ours."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)

FinishReason = Literal["stop", "length", "abort", "tool_calls"]


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --------------------------------------------------------------------------
# Responses: shared
# --------------------------------------------------------------------------


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def build(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


def token_bytes(token: str) -> list[int]:
    """UTF-8 bytes of a token string, as the chat logprobs `bytes` field wants."""
    return list(token.encode("utf-8", errors="surrogatepass"))


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "radixserve"
    root: str | None = None  # a LoRA adapter: its path
    parent: str | None = None  # a LoRA adapter: the base model
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# --------------------------------------------------------------------------
# Responses: /v1/completions
# --------------------------------------------------------------------------


class CompletionLogprobs(_Response):
    """Completions-API logprobs: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(_Response):
    id: str = Field(default_factory=lambda: _new_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamChoice(_Response):
    index: int
    text: str = ""
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionStreamResponse(_Response):
    """One SSE chunk; reuse the same id/created across a stream."""

    id: str = Field(default_factory=lambda: _new_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionStreamChoice] = Field(default_factory=list)
    usage: UsageInfo | None = None


# --------------------------------------------------------------------------
# Responses: /v1/chat/completions
# --------------------------------------------------------------------------


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)

    @classmethod
    def build(
        cls, token: str, logprob: float, top: list[tuple[str, float]] | None = None
    ) -> ChatTokenLogprob:
        alternatives = [TopLogprob(token=t, logprob=lp, bytes=token_bytes(t)) for t, lp in top or []]
        return cls(token=token, logprob=logprob, bytes=token_bytes(token), top_logprobs=alternatives)


class ChatChoiceLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class _SparseResponse(_Response):
    """Serialized without its None fields, as OpenAI sends stream deltas."""

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_SparseResponse):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_SparseResponse):
    """A piece of a streamed call: the first has id, type and name; later ones arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatCompletionChoice(_Response):
    index: int
    message: ChatMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(_Response):
    id: str = Field(default_factory=lambda: _new_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # OpenAI omits absent delta fields ({} on the final chunk) rather than sending nulls.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(_Response):
    index: int
    delta: DeltaMessage = Field(default_factory=DeltaMessage)
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionStreamResponse(_Response):
    """One SSE chunk; reuse the same id/created across a stream."""

    id: str = Field(default_factory=lambda: _new_id("chatcmpl"))
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice] = Field(default_factory=list)
    usage: UsageInfo | None = None


# --------------------------------------------------------------------------
# Server-sent events
# --------------------------------------------------------------------------

SSE_DONE = "data: [DONE]\n\n"


def sse_event(chunk: BaseModel | dict[str, Any]) -> str:
    """Format one chunk as an SSE `data:` event."""
    if isinstance(chunk, BaseModel):
        payload = chunk.model_dump_json(by_alias=True)
    else:
        payload = json.dumps(chunk, separators=(",", ":"))
    return f"data: {payload}\n\n"
