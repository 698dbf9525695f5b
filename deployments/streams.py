"""Fan-out of one API request into engine calls, and fan-in of their delta streams."""
from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ray.serve.exceptions import BackPressureError, RequestCancelledError

from deployments.channel import ChannelHub, submit
from deployments.engine_replica import EngineCall
from deployments.errors import OVERLOADED_MESSAGE, APIError
from deployments.metrics import record_finished_engine_call
from engine import IncrementalDetokenizer, WireDelta

logger = logging.getLogger(__name__)

LAST_DELTA_TIMEOUT_S = 30.0  # a channel delta is at most a step behind its call's end


@dataclass
class ChoiceState:
    """Everything received so far for one choice. Text is decoded here, from the token ids
    the replica streams (`detok`: an IncrementalDetokenizer with the request's stop strings,
    so the text ends where the engine stopped)."""

    index: int
    prompt_index: int
    detok: IncrementalDetokenizer
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list | None = None  # per prompt token: [(token, logprob)] or None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def add(self, delta: WireDelta) -> str:
        """Take in one delta; returns its text."""
        for token in delta.token_ids:
            if not self.detok.stopped:
                self.detok.add(token)
        text = self.detok.take_delta(final=delta.finished)
        self.text.append(text)
        self.token_ids += delta.token_ids
        if delta.extras:  # (middle deltas leave out what does not change: engine/core/outputs.py)
            self.logprobs += delta.extra("logprobs") or []
            self.top_logprobs += delta.extra("top_logprobs") or []
            if delta.extra("prompt_logprobs") is not None:
                self.prompt_logprobs = delta.extras["prompt_logprobs"]
                self.prompt_top_logprobs = delta.extra("prompt_top_logprobs")
            self.prompt_tokens = delta.extra("prompt_tokens", self.prompt_tokens)
            self.cached_tokens = delta.extra("cached_tokens", self.cached_tokens)
        self.completion_tokens = delta.completion_tokens
        if delta.finished:
            self.finish_reason = delta.finish_reason
        return text


def error_of(item: WireDelta | dict) -> APIError | None:
    """The APIError of an error item (a dict with "error"); None for a delta."""
    if isinstance(item, WireDelta) or "error" not in item:
        return None
    status = item.get("status", 500)
    error = APIError.unavailable(item["error"]) if status == 503 else APIError(item["error"], status=status)
    error.code = item.get("code")
    return error


async def merged_stream(handle, calls: list[EngineCall], hub: ChannelHub | None = None,
                        window: int | None = None) -> AsyncIterator[list[tuple[int, WireDelta | dict]]]:
    """Yield batches of (call index, item: a WireDelta, or an error dict) from all calls:
    everything that arrived since the
    consumer last asked (at least one). With a `hub`, deltas come on its delta channels where
    open (deployments/channel.py). At most `window` calls are in flight at once (None: all):
    the next starts as one ends, so a request of more prompts x choices than the engine
    takes at once runs through it in turn instead of being refused for the engine's bound.
    Closing this generator (e.g. the HTTP client went away) cancels every call started,
    which aborts them in the engine; the rest never start."""
    queue: asyncio.Queue = asyncio.Queue()
    finished = [asyncio.Event() for _ in calls]
    closing = False  # the consumer left: the calls' cancellation below is expected

    loads = hub.loads if hub is not None else None  # the ingress's admission gate
    refused: set[int] = set()  # calls the engine's bound refused: they freed no room

    def deliver(i: int, item: WireDelta) -> None:
        if item.finished:
            record_finished_engine_call(item)
            finished[i].set()
            if loads is not None:
                loads.call_finished()
        queue.put_nowait((i, item))

    for i, call in enumerate(calls):
        if hub is not None:
            call.channel = hub.ingress_id
            hub.listen(call.request_id, functools.partial(deliver, i))
    responses, tasks = [], []

    async def pump(i: int, response) -> None:
        try:
            async for item in response:
                if isinstance(item, WireDelta):
                    deliver(i, item)
                elif "open_channel" in item:
                    hub.open(item["open_channel"])
                elif "on_channel" in item:
                    continue  # its deltas come on the channel (ON_CHANNEL, deployments/channel.py)
                elif "error" in item:
                    if loads is not None and "load" in item:  # the engine's bound refused it
                        refused.add(i)
                        loads.report(*item["load"])
                    await queue.put((i, item))
                    return
            # On a channel, the call ends as its last delta is sent: wait for it there.
            await asyncio.wait_for(finished[i].wait(), LAST_DELTA_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except asyncio.TimeoutError:
            logger.error("engine call %s ended without its last delta", calls[i].request_id)
            await queue.put((i, {"error": "the engine's stream ended early", "status": 500}))
        except BackPressureError:  # Serve's queue bound (max_queued_requests): same as the engine's
            await queue.put((i, {"error": OVERLOADED_MESSAGE, "status": 503}))
        except RequestCancelledError:
            if closing:
                return
            logger.warning("engine call %s was cancelled", calls[i].request_id)
            await queue.put((i, {"error": "engine call was cancelled", "status": 503}))
        except Exception as e:  # noqa: BLE001 - a replica failure becomes a 500 for this call
            logger.exception("engine call %s failed", calls[i].request_id)
            await queue.put((i, {"error": f"engine replica failed: {type(e).__name__}", "status": 500}))
        finally:
            queue.put_nowait((i, None))  # unbounded: never waits, even while cancelled

    def start_next() -> None:
        i = len(responses)
        responses.append(submit(handle.generate, calls[i]))
        tasks.append(asyncio.create_task(pump(i, responses[i])))

    for _ in range(min(window or len(calls), len(calls))):
        start_next()
    try:
        remaining = len(calls)
        while remaining:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            ended = sum(item is None for _, item in batch)
            remaining -= ended
            for _ in range(min(ended, len(calls) - len(responses))):
                start_next()  # each call that ended makes room for the next
            batch = [(i, item) for i, item in batch if item is not None]
            if batch:
                yield batch
    finally:
        closing = True
        if loads is not None and any(not f.is_set() and i not in refused for i, f in enumerate(finished)):
            loads.call_finished()  # calls cut short (client gone, failures): room may have opened
        for task in tasks:
            task.cancel()
        for response in responses:
            response.cancel()
        if hub is not None:
            for call in calls:
                hub.forget(call.request_id)


async def prepend(first, stream: AsyncIterator) -> AsyncIterator:
    """`stream` with `first` (already read off it; None: nothing) in front again."""
    if first is not None:
        yield first
    async for item in stream:
        yield item


def merge_deltas(batch: list[tuple[int, WireDelta | dict]]) -> list[tuple[int, WireDelta | dict]]:
    """Join each call's consecutive deltas in a batch into one (first-seen call order).
    An error item ends its call's merging: it is kept as it is, after what came before."""
    merged: dict[int, WireDelta] = {}
    errors: list[tuple[int, dict]] = []
    for i, item in batch:
        if not isinstance(item, WireDelta):
            errors.append((i, item))
        elif i in merged:
            merged[i] = merged[i].then(item)
        else:
            merged[i] = item
    return list(merged.items()) + errors
