"""Fan-out of one API request into engine calls, and fan-in of their delta streams."""
from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ray.serve import context as serve_context
from ray.serve.exceptions import RequestCancelledError

from deployments.engine_replica import EngineCall
from deployments.errors import APIError
from deployments.metrics import record_finished_engine_call

logger = logging.getLogger(__name__)


@dataclass
class ChoiceState:
    """Everything received so far for one choice."""

    index: int
    prompt_index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def add(self, delta: dict) -> None:
        self.text.append(delta["text"])
        self.token_ids += delta["token_ids"]
        self.logprobs += delta.get("logprobs") or []
        self.top_logprobs += delta.get("top_logprobs") or []
        if delta.get("prompt_logprobs") is not None:
            self.prompt_logprobs = delta["prompt_logprobs"]
        self.prompt_tokens = delta["prompt_tokens"]
        self.cached_tokens = delta["cached_tokens"]
        self.completion_tokens = delta["completion_tokens"]
        if delta["finished"]:
            self.finish_reason = delta["finish_reason"]


def error_of(item: dict) -> APIError | None:
    if "error" not in item:
        return None
    status = item.get("status", 500)
    if status == 503:
        return APIError.unavailable(item["error"])
    return APIError(item["error"], status=status)


def _submit(handle, call: EngineCall):
    """`handle.generate.remote(call)` under its own Serve-internal request id.

    Handle calls made while serving one HTTP request inherit that request's internal id,
    and Serve's router matches pending requests to chosen replicas by that id: with a
    router that is not FIFO (ours), sibling calls (n > 1, batched prompts) would take each
    other's replica assignment and one would wait forever. A fresh id per call, set in a
    copied context so the HTTP request's own context is untouched, keeps them apart.
    """
    def submit():
        serve_context._set_request_context(_internal_request_id=uuid.uuid4().hex)
        return handle.generate.remote(call)

    return contextvars.copy_context().run(submit)


async def merged_stream(handle, calls: list[EngineCall]) -> AsyncIterator[tuple[int, dict]]:
    """Yield (call index, item) from all calls as items arrive. Closing this generator
    (e.g. the HTTP client went away) cancels every call, which aborts them in the engine."""
    responses = [_submit(handle, call) for call in calls]
    queue: asyncio.Queue = asyncio.Queue()
    closing = False  # the consumer left: the calls' cancellation below is expected

    async def pump(i: int, response) -> None:
        try:
            async for item in response:
                if item.get("finished"):
                    record_finished_engine_call(item)
                await queue.put((i, item))
        except asyncio.CancelledError:
            raise
        except RequestCancelledError:
            if closing:
                return
            logger.warning("engine call %s was cancelled", calls[i].request_id)
            await queue.put((i, {"error": "engine call was cancelled", "status": 503}))
        except Exception as e:  # noqa: BLE001 - a replica failure becomes a 500 for this call
            logger.exception("engine call %s failed", calls[i].request_id)
            await queue.put((i, {"error": f"engine replica failed: {type(e).__name__}", "status": 500}))
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(responses)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            else:
                yield i, item
    finally:
        closing = True
        for task in tasks:
            task.cancel()
        for response in responses:
            response.cancel()
