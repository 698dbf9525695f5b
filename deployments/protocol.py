"""OpenAI API request/response models, as radixserve's HTTP server speaks them.

Requests are parsed "strict-ish": unknown fields are ignored (OpenAI clients
send many we don't use), but a wrong type is an error rather than silently
coerced ("abc" or "5" for max_tokens, a string temperature). Numeric ranges
that the engine owns (temperature, top_p, penalties, ...) are validated by
`engine.SamplingParams`; here we only check what the HTTP layer itself needs.

The answers' models are in deployments/protocol_responses.py, and the mapping from a request
to `engine.SamplingParams` keyword arguments in deployments/request_sampling.py.
"""
from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

MAX_N = 16
MAX_LOGPROBS = 20

Prompt = str | list[int]  # one prompt after batch normalisation


class _Request(BaseModel):
    """Base of request models: wrong types fail, unknown fields are dropped."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


# --------------------------------------------------------------------------
# Request pieces shared by both endpoints
# --------------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    name: str = "schema"
    description: str | None = None
    # `schema` would shadow BaseModel.schema(), hence the alias.
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    # One flat model rather than a tagged union so errors have plain locations.
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_needed(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format.json_schema is required when type is 'json_schema'")
        return self


class SamplingFields(_Request):
    """Fields with the same meaning on /v1/completions and /v1/chat/completions."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # SGLang extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None
    skip_special_tokens: bool | None = None
    # OpenAI's structured output (chat; accepted on completions too, as vLLM/SGLang do)
    response_format: ResponseFormat | None = None

    logit_bias: dict[str, Any] | None = None  # token id -> bias in [-100, 100]
    min_tokens: int | None = None  # no EOS / stop_token_ids before this many tokens (vLLM's)
    include_stop_str_in_output: bool | None = None  # the text keeps the stop string it hit
    # Scheduling (vLLM's `priority`: lower is served first; engine/core/admission.py), and the
    # longest this request may wait for admission (engine/core/queue_deadlines.py): past it, a 408.
    priority: int | None = None
    queue_timeout_s: float | None = None
    # Fields other servers take that radixserve does not honour: a 400 when set to anything
    # but their "off" value, never a silent 200 (vLLM refuses what it does not support).
    best_of: int | None = None
    suffix: str | None = None
    echo: bool = False
    _honoured: ClassVar[frozenset[str]] = frozenset()  # of the fields above, per endpoint

    @model_validator(mode="after")
    def _refuse_unhonoured(self) -> SamplingFields:
        refused = [name for name, off in _OFF_VALUES.items()
                   if name not in self._honoured and getattr(self, name) not in off]
        if self.best_of is not None and self.best_of == self.n:
            refused.remove("best_of")  # n of n: exactly what n alone gives
        elif "best_of" in refused:
            refused[refused.index("best_of")] = "best_of (other than n)"
        if refused:
            raise ValueError(f"{', '.join(refused)}: not supported by this server; leave "
                             f"{'it' if len(refused) == 1 else 'them'} unset")
        return self

    @model_validator(mode="after")
    def _one_constraint(self) -> SamplingFields:
        wants_format = self.response_format is not None and self.response_format.type != "text"
        constraints = [self.regex, self.json_schema, self.ebnf]
        if wants_format and any(c is not None for c in constraints):
            raise ValueError("response_format cannot be combined with regex, json_schema or ebnf")
        return self

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response should end with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


_OFF_VALUES = {"best_of": (None,), "suffix": (None, ""), "echo": (False,)}

# --------------------------------------------------------------------------
# /v1/completions
# --------------------------------------------------------------------------

_PROMPT_TYPE_MSG = (
    "prompt must be a string, a list of token ids, a list of strings, "
    "or a list of token-id lists"
)


def _is_token_ids(value: object) -> bool:
    # bool is an int subclass; `true` is not a token id.
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    )


class CompletionRequest(SamplingFields):
    # Validated by `_check_prompt` (one clear message instead of an error per union branch).
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the text starts with the prompt; with logprobs, prompt tokens are scored
    _honoured: ClassVar[frozenset[str]] = frozenset({"echo"})
    # SGLang's logprob_start_len: score prompt tokens from this index (implies echo scoring).
    prompt_logprobs_start: int | None = Field(default=None, ge=0)

    @field_validator("prompt", mode="plain")
    @classmethod
    def _check_prompt(cls, value: object) -> object:
        if isinstance(value, str):
            if not value:
                raise ValueError("prompt must not be empty")
            return value
        if not isinstance(value, list) or not value:
            raise ValueError(_PROMPT_TYPE_MSG + " (and must not be empty)")
        if _is_token_ids(value) or all(isinstance(p, str) and p for p in value):
            return list(value)
        if all(_is_token_ids(p) and p for p in value):
            return [list(p) for p in value]
        raise ValueError(_PROMPT_TYPE_MSG + "; token ids must be non-negative integers")


    def prompts(self) -> list[Prompt]:
        """The batch of prompts; each gets its own `n` choices, in order."""
        p = self.prompt
        if isinstance(p, str) or _is_token_ids(p):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# /v1/chat/completions
# --------------------------------------------------------------------------

Role = Literal["system", "user", "assistant", "tool", "developer"]


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCallParam(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallParam(_Request):
    """A call an assistant turn made (in the history sent back)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam


class FunctionDefinition(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON schema of the arguments
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatMessageParam(_Request):
    """One input message. Only text content is supported."""

    role: Role
    # None is allowed for assistant turns that only carried tool calls.
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    reasoning_content: str | None = None  # a thinking model's earlier reasoning

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: object) -> object:
        # Give one readable error for image/audio parts instead of pydantic's per-branch noise.
        if isinstance(value, list):
            for i, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(
                        f"content part {i} has type {kind!r}; only 'text' parts are supported"
                    )
        return value

    def text(self) -> str:
        """Content flattened to a string (text parts joined, as OpenAI does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def as_template_dict(self) -> dict[str, Any]:
        """{role, content} (+ tool_calls, tool_call_id, name, reasoning_content when given)
        as chat templates (HF apply_chat_template) expect. Tool-call arguments become objects:
        templates write them with `tojson`."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                for c in self.tool_calls]
        return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    # vLLM's echo on chat: the reply's content starts with the last message's content when
    # that message is the assistant's own (a reply being continued); otherwise nothing.
    echo: bool = False
    _honoured: ClassVar[frozenset[str]] = frozenset({"echo"})

    @model_validator(mode="after")
    def _check_combinations(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice requires tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {
                t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
        if self.forced_tool_call and (self.regex or self.json_schema or self.ebnf or (
                self.response_format is not None and self.response_format.type != "text")):
            raise ValueError("tool_choice 'required' or a named function cannot be combined "
                             "with response_format, regex, json_schema or ebnf")
        return self

    @property
    def active_tools(self) -> list[ChatTool]:
        """The tools the model sees: none with tool_choice "none"."""
        return [] if self.tool_choice == "none" else list(self.tools or [])

    @property
    def forced_tool_call(self) -> bool:
        """tool_choice "required" or a named function: output shaped by a grammar."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def echoed_text(self) -> str:
        """What `echo` puts ahead of the reply's content."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens (the newer name) wins over max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Request):
    """POST /tokenize: a text prompt (or a batch of them), or chat `messages` to render."""

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessageParam] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


