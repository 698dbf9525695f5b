"""Turn engine deltas into OpenAI response objects and stream chunks."""
from __future__ import annotations

from deployments.protocol import (
    ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionResponse, ChatCompletionStreamChoice,
    ChatCompletionStreamResponse, ChatMessage, ChatTokenLogprob, CompletionChoice,
    CompletionLogprobs, CompletionResponse, CompletionStreamChoice, CompletionStreamResponse,
    DeltaMessage, UsageInfo,
)
from deployments.streams import ChoiceState


class TokenNamer:
    """Token id -> the string OpenAI shows for it in logprobs."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        return self.tokenizer.token_str(token_id)


def usage_of(choices: list[ChoiceState]) -> UsageInfo:
    """Prompt tokens once per prompt (not per choice); cached tokens as the first choice of
    each prompt saw them."""
    firsts: dict[int, ChoiceState] = {}
    for c in choices:
        firsts.setdefault(c.prompt_index, c)
    return UsageInfo.build(prompt_tokens=sum(c.prompt_tokens for c in firsts.values()),
                           completion_tokens=sum(c.completion_tokens for c in choices),
                           cached_tokens=sum(c.cached_tokens for c in firsts.values()))


def completion_logprobs(token_ids: list[int], logprobs: list[float],
                        top: list[list[tuple[int, float]]], name: TokenNamer,
                        offset: int = 0) -> CompletionLogprobs:
    tokens = [name(t) for t in token_ids]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=list(logprobs),
        top_logprobs=[{name(t): lp for t, lp in alts} for alts in top] or [None] * len(tokens),
        text_offset=offsets)


def chat_logprobs(token_ids: list[int], logprobs: list[float],
                  top: list[list[tuple[int, float]]], name: TokenNamer) -> ChatChoiceLogprobs:
    content = [ChatTokenLogprob.build(name(t), lp, [(name(a), alp) for a, alp in (top[i] if top else [])])
               for i, (t, lp) in enumerate(zip(token_ids, logprobs))]
    return ChatChoiceLogprobs(content=content)


def completion_response(model: str, choices: list[ChoiceState], want_logprobs: bool,
                        name: TokenNamer) -> CompletionResponse:
    out = []
    for c in choices:
        lp = (completion_logprobs(c.token_ids, c.logprobs, c.top_logprobs, name)
              if want_logprobs else None)
        out.append(CompletionChoice(index=c.index, text="".join(c.text), logprobs=lp,
                                    finish_reason=c.finish_reason))
    return CompletionResponse(model=model, choices=out, usage=usage_of(choices))


def chat_response(model: str, choices: list[ChoiceState], want_logprobs: bool,
                  name: TokenNamer) -> ChatCompletionResponse:
    out = []
    for c in choices:
        lp = chat_logprobs(c.token_ids, c.logprobs, c.top_logprobs, name) if want_logprobs else None
        out.append(ChatCompletionChoice(index=c.index, message=ChatMessage(content="".join(c.text)),
                                        logprobs=lp, finish_reason=c.finish_reason))
    return ChatCompletionResponse(model=model, choices=out, usage=usage_of(choices))


def completion_chunk(base: dict, c: ChoiceState, delta: dict, want_logprobs: bool,
                     name: TokenNamer) -> CompletionStreamResponse:
    lp = None
    if want_logprobs and delta["token_ids"]:
        lp = completion_logprobs(delta["token_ids"], delta.get("logprobs") or [],
                                 delta.get("top_logprobs") or [], name)
    choice = CompletionStreamChoice(index=c.index, text=delta["text"], logprobs=lp,
                                    finish_reason=delta["finish_reason"] if delta["finished"] else None)
    return CompletionStreamResponse(**base, choices=[choice])


def chat_chunk(base: dict, c: ChoiceState, delta: dict, want_logprobs: bool,
               name: TokenNamer, first: bool) -> ChatCompletionStreamResponse:
    lp = None
    if want_logprobs and delta["token_ids"]:
        lp = chat_logprobs(delta["token_ids"], delta.get("logprobs") or [],
                           delta.get("top_logprobs") or [], name)
    message = DeltaMessage(role="assistant" if first else None, content=delta["text"] or None)
    choice = ChatCompletionStreamChoice(index=c.index, delta=message, logprobs=lp,
                                        finish_reason=delta["finish_reason"] if delta["finished"] else None)
    return ChatCompletionStreamResponse(**base, choices=[choice])
