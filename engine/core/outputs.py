"""What the engine hands back: a finished request, or a streamed delta of one."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    cached_tokens: int
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float | None] | None = None  # per prompt token (params.prompt_logprobs_start)
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None  # with top_logprobs
    speculative: dict | None = None  # the request's drafted / accepted counts (SpecStats.as_dict)


@dataclass
class StreamDelta:
    """New tokens and text of one request since its previous delta."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float | None] | None = None  # in the first delta only
    queue_time: float | None = None  # seconds from arrival to first admission; first delta only
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None  # first delta only

    def then(self, later: "StreamDelta") -> "StreamDelta":
        """This delta followed by `later`, as one (a consumer that fell behind sends fewer,
        larger deltas: one per wake-up, not one per token)."""
        return StreamDelta(
            request_id=self.request_id, token_ids=self.token_ids + later.token_ids,
            text=self.text + later.text, finished=later.finished,
            finish_reason=later.finish_reason, prompt_tokens=later.prompt_tokens,
            cached_tokens=later.cached_tokens, completion_tokens=later.completion_tokens,
            logprobs=_joined(self.logprobs, later.logprobs),
            top_logprobs=_joined(self.top_logprobs, later.top_logprobs),
            prompt_logprobs=self.prompt_logprobs if self.prompt_logprobs is not None
            else later.prompt_logprobs,
            queue_time=self.queue_time if self.queue_time is not None else later.queue_time,
            prompt_top_logprobs=self.prompt_top_logprobs if self.prompt_top_logprobs is not None
            else later.prompt_top_logprobs)


def _joined(a: list | None, b: list | None) -> list | None:
    if a is None or b is None:
        return a if b is None else b
    return a + b


# A delta as the serving layer's delta channels carry it (`AsyncEngine.stream_to(...,
# wire=True)`): a plain tuple
#     (request_id, token_ids, finished, finish_reason, completion_tokens, extras)
# where `extras` is None, or a dict of the StreamDelta fields beyond those that are set
# (`delta_extras`). A step at batch 512 makes 512 deltas under the engine's GIL, and a tuple
# costs a fraction of a StreamDelta to build and to pickle; the extras appear in a request's
# first and last delta and when it asked for logprobs.
WireDelta = tuple

_EXTRA_FIELDS = ("prompt_tokens", "cached_tokens", "queue_time", "logprobs", "top_logprobs",
                 "prompt_logprobs", "prompt_top_logprobs")


def delta_extras(delta: StreamDelta) -> dict:
    """A delta's fields beyond the wire tuple's, those that are set."""
    out = {}
    for name in _EXTRA_FIELDS:
        value = getattr(delta, name)
        if value is not None:
            out[name] = value
    return out


def wire_dict(delta: WireDelta) -> dict:
    """A wire tuple as the dict the serving layer reads (the fields of `wire_of` plus extras)."""
    out = {"token_ids": delta[1], "finished": delta[2], "finish_reason": delta[3],
           "completion_tokens": delta[4]}
    if delta[5] is not None:
        out.update(delta[5])
    return out


def wire_of(delta: StreamDelta) -> WireDelta:
    return (delta.request_id, delta.token_ids, delta.finished, delta.finish_reason,
            delta.completion_tokens, delta_extras(delta))
