"""What the engine hands back: a finished request, or a streamed delta of one."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import repeat
from typing import Any, NamedTuple


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


class WireDelta(NamedTuple):
    """A delta as the serving layer forwards it (`stream_to(..., wire=True)`, the delta
    channels, the ingress). A step at batch 512 makes 512 deltas under the engine's GIL:
    a tuple costs a fraction of a StreamDelta to build and to pickle. `extras` is None, or
    the StreamDelta fields beyond these that are set (`delta_extras`); they come in a
    request's first and last delta, and in each one when it asked for logprobs."""

    request_id: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    completion_tokens: int
    extras: dict | None = None

    def extra(self, name: str, default: Any = None) -> Any:
        """One of the `extras`, or `default` when this delta does not carry it."""
        extras = self.extras
        return default if extras is None else extras.get(name, default)

    def then(self, later: WireDelta) -> WireDelta:
        """This delta followed by `later`, as one (StreamDelta.then's rules: the prompt's
        logprobs stay from the first, the output's are joined)."""
        extras = self.extras
        if later.extras:
            first = self.extras or {}
            extras = {**first, **later.extras}
            for name in ("logprobs", "top_logprobs"):
                if name in first and name in later.extras:
                    extras[name] = first[name] + later.extras[name]
            for name in ("prompt_logprobs", "prompt_top_logprobs", "queue_time"):
                if name in first:
                    extras[name] = first[name]
        return WireDelta(self.request_id, self.token_ids + later.token_ids, later.finished,
                         later.finish_reason, later.completion_tokens, extras)


# A WireDelta from the tuple of its six fields, without the NamedTuple's Python-level
# `__new__` (a C call): the engine builds one per request per step, a batch's arrival
# rebuilds hundreds.
wire_delta_of: Callable[[tuple], WireDelta] = partial(tuple.__new__, WireDelta)


class WireBatch(list):
    """WireDeltas that travel as one pickled object (a step's deltas for one delta channel,
    or for the engine process's parent). Pickled as its six columns: a NamedTuple pickled
    as itself costs Python calls to save and to load (at batch 512, several times a bare
    tuple's time: scripts/bench_wire_delta.py); the columns save as fast as tuples."""

    def __reduce__(self) -> tuple:
        return _wire_batch, (list(zip(*self)),)


def _wire_batch(columns: list[tuple]) -> WireBatch:
    return WireBatch(map(tuple.__new__, repeat(WireDelta), zip(*columns)))


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


def wire_of(delta: StreamDelta) -> WireDelta:
    return WireDelta(delta.request_id, delta.token_ids, delta.finished, delta.finish_reason,
                     delta.completion_tokens, delta_extras(delta))
