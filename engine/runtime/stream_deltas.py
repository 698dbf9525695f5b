"""A request's new tokens after a step, as what AsyncEngine hands a caller: a StreamDelta,
or the WireDelta a server forwards (engine/core/outputs.py); and back from a WireDelta
to a StreamDelta (ProcessAsyncEngine's `generate`)."""
from __future__ import annotations

from engine.core.outputs import StreamDelta, WireDelta, wire_delta_of, wire_of
from engine.core.request import Request


def stream_delta(req: Request, new_tokens: list[int], finished: bool,
                 detokenize: bool) -> StreamDelta:
    """The delta with text when `detokenize` (or the request has stop strings, which the
    engine decodes anyway); counts and prompt logprobs ride on the first one."""
    text = ""
    if detokenize or req.params.stop:
        req.detok.catch_up(req.output_ids)
        text = req.detok.take_delta(final=finished)
    n = len(new_tokens)
    first = req.num_output == n
    return StreamDelta(
        request_id=req.request_id, token_ids=new_tokens, text=text, finished=finished,
        finish_reason=req.finish_reason if finished else None,
        prompt_tokens=req.num_prompt, cached_tokens=req.cached_tokens,
        completion_tokens=req.num_output,
        prompt_logprobs=req.prompt_logprobs if first else None,
        queue_time=_queue_time(req) if first else None,
        prompt_top_logprobs=req.prompt_top_logprobs if first else None,
        logprobs=req.output_logprobs[len(req.output_logprobs) - n:] if req.params.logprobs and n else None,
        top_logprobs=(req.output_top_logprobs[len(req.output_top_logprobs) - n:]
                      if req.params.top_logprobs and n else None))


def wire_update(req: Request, new_tokens: list[int], finished: bool) -> WireDelta:
    """In the common case (a middle delta, no logprobs) one without extras, built without
    a StreamDelta and without decoding text."""
    params = req.params
    if finished or params.logprobs or params.top_logprobs or req.num_output == len(new_tokens):
        return wire_of(stream_delta(req, new_tokens, finished, detokenize=False))
    return wire_delta_of((req.request_id, new_tokens, False, None, req.num_output, None))


def _queue_time(req: Request) -> float | None:
    return None if req.scheduled_at is None else max(0.0, req.scheduled_at - req.arrival)


class WireToStreamDelta:
    """One stream's WireDeltas as StreamDeltas without text. A middle WireDelta leaves out
    the prompt's counts; every StreamDelta carries them, as AsyncEngine's do."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def __call__(self, delta: WireDelta) -> StreamDelta:
        out = StreamDelta(request_id=delta.request_id, token_ids=delta.token_ids, text="",
                          finished=delta.finished, finish_reason=delta.finish_reason,
                          completion_tokens=delta.completion_tokens,
                          prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens)
        if delta.extras:
            for name, value in delta.extras.items():
                setattr(out, name, value)
            self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        return out
