"""Pooling requests as callers write them, offline (`LLM.embed`, `LLM.score`) and served
(`AsyncPooling`: the server's batcher, which packs concurrent requests into shared forwards
on one worker thread so the event loop never runs a forward)."""
from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from engine.runtime.exit_stop import EXIT_WAIT_S, stop_at_exit
from engine.runtime.pooling_input import PoolInput

if TYPE_CHECKING:
    import torch

    from engine.config import EngineConfig


class RequestCount(Protocol):
    requests: int


class PoolingBackend(Protocol):
    """What the requests use of engine/runtime/pooling_engine.py's PoolingEngine (built
    above this module and handed in)."""

    task: str
    config: EngineConfig
    max_context: int
    stats: RequestCount

    def encode_many(self, texts: list[str], truncate: int | None = None) -> list[PoolInput]: ...

    def encode_pair(self, query: str, document: str, truncate: int | None = None) -> PoolInput: ...

    def check_all(self, items: list[PoolInput]) -> None: ...

    def check_dimensions(self, dimensions: int | None) -> None: ...

    def embed(self, items: list[PoolInput], dimensions: int | None = None) -> torch.Tensor: ...

    def score(self, items: list[PoolInput]) -> list[float]: ...

EmbedInput = str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]


def embedding_inputs(engine: PoolingBackend, inputs: EmbedInput,
                     truncate: int | None = None) -> list[PoolInput]:
    """Texts or token ids (one or a list) -> checked inputs. `truncate`: at most that many
    tokens per input (-1: the model's limit); texts keep their special tokens, token ids
    keep their last `truncate`. Raises ValueError for an input that cannot run."""
    limit = _truncation(engine, truncate)
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    if not inputs:
        raise ValueError("input is empty")
    texts = [x for x in inputs if isinstance(x, str)]
    if any(not x for x in texts):
        raise ValueError("input contains an empty string")
    encoded = iter(engine.encode_many(texts, limit) if texts else [])
    items = []
    for x in inputs:
        if isinstance(x, str):
            items.append(next(encoded))
        else:
            ids = [int(t) for t in x]
            items.append(PoolInput(ids[-limit:] if limit else ids))
    engine.check_all(items)
    return items


def pair_inputs(engine: PoolingBackend, pairs: Sequence[tuple[str, str]],
                truncate: int | None = None) -> list[PoolInput]:
    """(query, document) pairs -> checked cross-encoder inputs."""
    if not pairs or any(not q or not d for q, d in pairs):
        raise ValueError("queries and documents must be non-empty strings")
    limit = _truncation(engine, truncate)
    items = [engine.encode_pair(q, d, limit) for q, d in pairs]
    engine.check_all(items)
    return items


def _truncation(engine: PoolingBackend, truncate: int | None) -> int | None:
    if truncate is None:
        return None
    if truncate == -1:
        return engine.max_context
    if truncate < 1:
        raise ValueError(f"truncate_prompt_tokens must be -1 or >= 1, got {truncate}")
    return min(truncate, engine.max_context)


class OfflinePooling:
    """`LLM(task=...)`'s pooling methods."""

    def __init__(self, engine: PoolingBackend) -> None:
        self.engine = engine

    def embed(self, inputs: EmbedInput, dimensions: int | None = None,
              truncate_prompt_tokens: int | None = None) -> list[list[float]]:
        if self.engine.task != "embed":
            raise ValueError(f"embed() needs task='embed'; this model serves {self.engine.task!r}")
        self.engine.check_dimensions(dimensions)
        items = embedding_inputs(self.engine, inputs, truncate_prompt_tokens)
        self.engine.stats.requests += 1
        return self.engine.embed(items, dimensions).tolist()

    def score(self, query: str, documents: Sequence[str],
              truncate_prompt_tokens: int | None = None) -> list[float]:
        if self.engine.task != "score":
            raise ValueError(f"score() needs task='score'; this model serves {self.engine.task!r}")
        items = pair_inputs(self.engine, [(query, d) for d in documents], truncate_prompt_tokens)
        self.engine.stats.requests += 1
        return self.engine.score(items)


class PoolingQueueFull(RuntimeError):
    """More pooling requests wait than `max_queued_requests` allows; retry later."""


@dataclass
class _Job:
    items: list[PoolInput]
    dimensions: int | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class AsyncPooling:
    """Requests from any number of coroutines, run by one worker thread: each round takes
    every job waiting (of the same `dimensions`, up to the engine's token budget) into one
    packed run, so concurrent small requests share forwards. A job whose caller left (its
    future cancelled) before its round is dropped unrun."""

    def __init__(self, engine: PoolingBackend) -> None:
        self.engine = engine
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._pending: list[_Job] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="pooling", daemon=True)
        self._thread.start()
        stop_at_exit(self)

    @property
    def waiting(self) -> int:
        return self._jobs.qsize() + len(self._pending)

    async def run(self, items: list[PoolInput], dimensions: int | None = None) -> list:
        """Vectors (task embed) or scores (task score) for checked `items`."""
        if self._stopping:
            raise RuntimeError("the pooling worker has stopped")
        limit = self.engine.config.max_queued_requests
        if limit and self.waiting >= limit:
            raise PoolingQueueFull(f"{self.waiting} pooling requests are waiting (limit {limit})")
        loop = asyncio.get_running_loop()
        job = _Job(items, dimensions, loop, loop.create_future())
        self._jobs.put(job)
        return await job.future

    def shutdown(self, timeout: float = EXIT_WAIT_S) -> None:
        """Stop after the round in progress; the jobs still waiting fail."""
        self._stopping = True
        self._jobs.put(None)
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stopping:
            first = self._pending.pop(0) if self._pending else self._jobs.get()
            if first is None:
                break
            round_ = self._gather(first)
            try:
                results = self._compute(round_)
            except Exception as e:  # noqa: BLE001 - every caller of the round hears of it
                for job in round_:
                    job.loop.call_soon_threadsafe(_set, job.future, None, e)
                continue
            for job, result in zip(round_, results):
                job.loop.call_soon_threadsafe(_set, job.future, result, None)
        self._fail_waiting()

    def _fail_waiting(self) -> None:
        error = RuntimeError("the pooling worker has stopped")
        waiting = self._pending
        while not self._jobs.empty():
            waiting.append(self._jobs.get_nowait())
        for job in filter(None, waiting):
            with contextlib.suppress(RuntimeError):  # its loop has closed: nobody waits
                job.loop.call_soon_threadsafe(_set, job.future, None, error)
        self._pending = []

    def _gather(self, first: _Job) -> list[_Job]:
        budget = max(self.engine.config.max_prefill_tokens, self.engine.max_context)
        round_, tokens = [first], sum(len(x.ids) for x in first.items)
        while tokens < budget:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is None or job.dimensions != first.dimensions:
                self._pending.append(job)  # the next round's (or the stop signal)
                break
            round_.append(job)
            tokens += sum(len(x.ids) for x in job.items)
        return [j for j in round_ if not j.future.cancelled()]

    def _compute(self, round_: list[_Job]) -> list[list]:
        items = [x for job in round_ for x in job.items]
        if not items:
            return []
        engine = self.engine
        flat = (engine.embed(items, round_[0].dimensions) if engine.task == "embed"
                else engine.score(items))
        engine.stats.requests += len(round_)
        out, start = [], 0
        for job in round_:
            out.append(flat[start:start + len(job.items)])
            start += len(job.items)
        return out


def _set(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
