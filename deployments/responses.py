"""Turn engine deltas into OpenAI response objects and stream chunks."""
from __future__ import annotations

from deployments.chat_output import ChatOutput
from deployments.protocol_responses import (
    ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionResponse, ChatCompletionStreamChoice,
    ChatCompletionStreamResponse, ChatMessage, ChatTokenLogprob, CompletionChoice,
    CompletionLogprobs, CompletionResponse, CompletionStreamChoice, CompletionStreamResponse,
    DeltaMessage, UsageInfo,
)
from deployments.streams import ChoiceState
from engine import WireDelta


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
                        offsets: list[int] | None = None, text: str = "") -> CompletionLogprobs:
    """`offsets`: each token's text_offset; without them, where each token is found in
    `text` (the text these tokens came out as)."""
    tokens = [name(t) for t in token_ids]
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=list(logprobs),
        top_logprobs=[{name(t): lp for t, lp in alts} for alts in top] or [None] * len(tokens),
        text_offset=offsets if offsets is not None else _offsets_in(tokens, text))


def _offsets_in(tokens: list[str], text: str) -> list[int]:
    """Where each token starts in `text`. A token not found where the text has got to (a
    special token the text skips, such as <s>) takes no room; a token's lone decoding may
    lack the space it has in context, so a match a couple of characters on still counts."""
    offsets, pos = [], 0
    for t in tokens:
        at = text.find(t, pos, pos + len(t) + 2) if t else -1
        offsets.append(pos if at < 0 else at)
        if at >= 0:
            pos = at + len(t)
    return offsets


def _output_logprobs(c: ChoiceState, start: int, end: int, name: TokenNamer,
                     shift: int = 0) -> CompletionLogprobs:
    """Logprobs of output tokens [start, end) of choice `c`. Offsets are the detokenizer's,
    fixed per token as it was added, so a stream's chunks carry the same offsets as the
    whole response; `shift`: the echoed prompt's length ahead of the output."""
    return completion_logprobs(c.token_ids[start:end], c.logprobs[start:end],
                               c.top_logprobs[start:end], name,
                               [o + shift for o in c.detok.token_offsets(start, end)])


def chat_logprobs(token_ids: list[int], logprobs: list[float],
                  top: list[list[tuple[int, float]]], name: TokenNamer) -> ChatChoiceLogprobs:
    content = [ChatTokenLogprob.build(name(t), lp, [(name(a), alp) for a, alp in (top[i] if top else [])])
               for i, (t, lp) in enumerate(zip(token_ids, logprobs))]
    return ChatChoiceLogprobs(content=content)


def completion_response(model: str, choices: list[ChoiceState], want_logprobs: bool,
                        name: TokenNamer,
                        echo: list[tuple[list[int], str]] | None = None) -> CompletionResponse:
    """`echo`: per choice, the prompt's token ids and text to put before the completion
    (OpenAI's legacy echo: the prompt tokens are scored too, the first with null)."""
    out = []
    for c in choices:
        prompt = echo[c.index] if echo is not None else None
        text = (prompt[1] if prompt else "") + "".join(c.text)
        lp = None
        if want_logprobs:
            lp = _output_logprobs(c, 0, len(c.token_ids), name, len(prompt[1]) if prompt else 0)
            if prompt is not None:
                lp = _with_prompt(lp, c, prompt, name)
        out.append(CompletionChoice(index=c.index, text=text, logprobs=lp,
                                    finish_reason=c.finish_reason))
    return CompletionResponse(model=model, choices=out, usage=usage_of(choices))


def _with_prompt(lp: CompletionLogprobs, c: ChoiceState, prompt: tuple[list[int], str],
                 name: TokenNamer) -> CompletionLogprobs:
    """The prompt's tokens ahead of the completion's (the first has no score: null)."""
    prompt_ids, prompt_text = prompt
    head = completion_logprobs(prompt_ids, [], [], name, text=prompt_text)
    tops = [None if alts is None else {name(t): v for t, v in alts}
            for alts in (c.prompt_top_logprobs or [None] * len(prompt_ids))]
    scores = list(c.prompt_logprobs or [None] * len(prompt_ids))
    return CompletionLogprobs(
        tokens=head.tokens + lp.tokens, token_logprobs=scores + lp.token_logprobs,
        top_logprobs=tops + lp.top_logprobs, text_offset=head.text_offset + lp.text_offset)


def chat_response(model: str, choices: list[ChoiceState], want_logprobs: bool,
                  name: TokenNamer, outputs: list[ChatOutput] | None = None) -> ChatCompletionResponse:
    """`outputs`: per choice, the reader of its reasoning and tool calls (None: plain text)."""
    out = []
    for c in choices:
        lp = chat_logprobs(c.token_ids, c.logprobs, c.top_logprobs, name) if want_logprobs else None
        fields, reason = {"content": "".join(c.text)}, c.finish_reason
        if outputs is not None:
            outputs[c.index].feed("".join(c.text), final=True)
            fields, reason = outputs[c.index].message_fields(), outputs[c.index].finish_reason(reason)
        out.append(ChatCompletionChoice(index=c.index, message=ChatMessage(**fields),
                                        logprobs=lp, finish_reason=reason))
    return ChatCompletionResponse(model=model, choices=out, usage=usage_of(choices))


def completion_chunk(base: dict, c: ChoiceState, delta: WireDelta, text: str, want_logprobs: bool,
                     name: TokenNamer, prompt: tuple[list[int], str] | None = None,
                     first: bool = False) -> CompletionStreamResponse:
    """One choice's chunk, after `c.add(delta)`. `prompt`: the echoed prompt (ids, text),
    which leads the first chunk (with its logprobs) and shifts every offset, as in
    `completion_response`."""
    lp = None
    if want_logprobs and (delta.token_ids or (first and prompt)):
        end = len(c.token_ids)
        lp = _output_logprobs(c, end - len(delta.token_ids), end, name,
                              len(prompt[1]) if prompt else 0)
        if first and prompt is not None:
            lp = _with_prompt(lp, c, prompt, name)
    if first and prompt is not None:
        text = prompt[1] + text
    choice = CompletionStreamChoice(index=c.index, text=text, logprobs=lp,
                                    finish_reason=delta.finish_reason if delta.finished else None)
    return CompletionStreamResponse(**base, choices=[choice])


def chat_chunk(base: dict, c: ChoiceState, delta: WireDelta, text: str, want_logprobs: bool,
               name: TokenNamer, first: bool,
               output: ChatOutput | None = None) -> ChatCompletionStreamResponse:
    lp = None
    if want_logprobs and delta.token_ids:
        lp = chat_logprobs(delta.token_ids, delta.extra("logprobs") or [],
                           delta.extra("top_logprobs") or [], name)
    role = "assistant" if first else None
    reason = delta.finish_reason if delta.finished else None
    if output is None:
        message = DeltaMessage(role=role, content=text or None)
    else:
        parts = output.feed(text, final=delta.finished)
        message = DeltaMessage(role=role, content=parts.content or None,
                               reasoning_content=parts.reasoning or None,
                               tool_calls=parts.wire_tool_calls())
        reason = output.finish_reason(reason)
    choice = ChatCompletionStreamChoice(index=c.index, delta=message, logprobs=lp,
                                        finish_reason=reason)
    return ChatCompletionStreamResponse(**base, choices=[choice])
