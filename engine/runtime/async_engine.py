"""AsyncEngine: the step loop on a background thread, streaming to asyncio callers.

Callers (any event loop, any thread) submit commands; the engine thread owns all engine
state and applies commands between steps, so the scheduler never needs a lock. Each
request's deltas travel back through an asyncio.Queue of the caller's loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from engine.config import EngineConfig
from engine.runtime.engine import Engine
from engine.runtime.exit_stop import stop_at_exit
from engine.runtime.engine_client import SHUTDOWN_TIMEOUT_S, DeltaSink, capacity_of, refuse_when_full
from engine.runtime.loop_handoff import deliver, set_exception, set_result
from engine.runtime.prefix_exchange import ExportedPrefix
from engine.core.outputs import StreamDelta, WireDelta
from engine.core.queue_deadlines import QueueFullError
from engine.core.sampling_params import SamplingParams
from engine.runtime.step_report import StepReport, step_for_streams, step_report
from engine.runtime.stream_deltas import stream_delta, wire_update

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    put: Callable[[StreamDelta | WireDelta | BaseException], None]  # runs on `loop`
    wire: bool = False  # put gets WireDeltas


class AsyncEngine:
    """The in-thread EngineClient (engine/runtime/engine_client.py). `detokenize=False`
    streams token ids with empty text: a server that decodes text in its front end
    (deployments/ingress.py) keeps that work off the engine thread. Requests with stop
    strings are decoded here all the same (the engine must see the stop)."""

    def __init__(self, config: EngineConfig, engine: Engine | None = None,
                 detokenize: bool = True, make_engine: Callable[[], Engine] | None = None) -> None:
        """Without `engine`, the engine thread builds it (`make_engine()`, or `Engine(config)`)
        and the constructor waits for it, re-raising its error. On a CPU with several torch
        threads this matters: once a second thread (the caller's, having loaded the model)
        also starts OpenMP regions, libgomp gives each its own team, and with more threads
        than cores they sleep between regions. SmolLM2 on two cores, stepped on the thread
        that did not load it: 62.4 ms a decoded token against 34.3 here.
        (Ray replicas get OMP_NUM_THREADS from their
        num_cpus: with 1, torch has no team to lose.)"""
        self.engine: Engine = engine  # type: ignore[assignment] - the thread sets it when None
        self.detokenize = detokenize
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._step_hooks: list[Callable[[Engine], None]] = []
        self._listeners: list[Callable[[StepReport], None]] = []
        self._stopped = threading.Event()
        built: Future = Future()
        make = None if engine is not None else make_engine or (lambda: Engine(config))
        self._thread = threading.Thread(target=self._run, args=(make, built),
                                        name="engine-loop", daemon=True)
        self._thread.start()
        stop_at_exit(self)
        built.result()  # waits for the build; its error is re-raised here
        self.config = self.engine.config

    # -- public API ---------------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[StreamDelta]:
        """Stream deltas of one request; leaving the iteration early aborts it."""
        deltas: asyncio.Queue = asyncio.Queue()
        await self._open(prompt, params, request_id, deltas.put_nowait)
        finished = False
        try:
            while True:
                item = await deltas.get()
                while not deltas.empty() and isinstance(item, StreamDelta) and not item.finished:
                    later = deltas.get_nowait()
                    if isinstance(later, BaseException):  # deliver what came before it first
                        deltas.put_nowait(later)
                        break
                    item = item.then(later)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._close(request_id, finished)

    async def stream_to(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                        put: DeltaSink, wire: bool = False) -> None:
        """Run one request, handing each delta to `put` on the caller's event loop (called
        in step order, several requests' in one wake-up); return once it has finished.
        Raises as `generate` does; cancelling the caller aborts the request. With `wire`,
        `put` gets `WireDelta`s (engine/core/outputs.py), the cheap form a server forwards."""
        done = asyncio.get_running_loop().create_future()

        def take(item: StreamDelta | WireDelta | BaseException) -> None:
            if done.done():
                return
            if isinstance(item, BaseException):
                done.set_exception(item)
                return
            put(item)
            if item.finished:
                done.set_result(None)

        await self._open(prompt, params, request_id, take, wire)
        finished = False
        try:
            await done
            finished = True
        finally:
            self._close(request_id, finished)

    async def _open(self, prompt, params: SamplingParams, request_id: str,
                    put: Callable[[StreamDelta | WireDelta | BaseException], None],
                    wire: bool = False) -> None:
        """Validate, check capacity and queue the request; its items go to `put`."""
        prompt_ids = self.engine.tokenize_prompt(prompt)
        if params.has_constraint:  # compile on the grammar pool, not on this event loop
            with contextlib.suppress(ValueError):  # validate() raises it again, below
                await asyncio.wrap_future(self.engine.grammars.submit(params))
        self.engine.validate(prompt_ids, params)  # a bad constraint raises here (cached compile)
        self.check_capacity()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._streams[request_id] = _Stream(asyncio.get_running_loop(), put, wire)
        self._commands.put(lambda: self._add(request_id, prompt_ids, params))

    def _close(self, request_id: str, finished: bool) -> None:
        self._streams.pop(request_id, None)
        if not finished:
            self._commands.put(lambda: self.engine.abort(request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request and wait until its KV slots are back in the pool."""
        await self.call(lambda engine: self._abort(request_id))

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
                loop.call_soon_threadsafe(set_result, fut, result)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(set_exception, fut, e)

        self._commands.put(run)
        return await fut

    async def stats(self) -> dict:
        return await self.call(lambda engine: engine.stats())

    async def flush_cache(self) -> None:
        """`Engine.flush_cache` between steps."""
        await self.call(lambda engine: engine.flush_cache())

    async def export_prefix(self, tokens: list[int], skip: int = 0) -> ExportedPrefix | None:
        return await self.call(lambda engine: engine.export_prefix(tokens, skip))

    async def cached_length(self, tokens: list[int]) -> int:
        return await self.call(lambda engine: engine.cached_length(tokens))

    async def import_prefix(self, prefix: ExportedPrefix) -> int:
        return await self.call(lambda engine: engine.import_prefix(prefix))

    async def load_lora(self, name: str, path: str) -> None:
        """`Engine.load_lora` between steps (reading the adapter stalls one step)."""
        await self.call(lambda engine: engine.load_lora(name, path))

    async def unload_lora(self, name: str) -> None:
        await self.call(lambda engine: engine.unload_lora(name))

    async def list_loras(self) -> list[dict]:
        return await self.call(lambda engine: engine.list_loras())

    def add_step_hook(self, hook: Callable[[Engine], None]) -> None:
        """Call `hook(engine)` on the engine thread after every step and command batch."""
        self._step_hooks.append(hook)

    def add_step_listener(self, listener: Callable[[StepReport], None]) -> None:
        """Call `listener(report)` on the engine thread after every step and command batch:
        the form ProcessAsyncEngine has too (its engine is in another process). Every
        listener gets the same report: a report drains the engine's cache events."""
        if not self._listeners:
            self._step_hooks.append(self._report_step)
        self._listeners.append(listener)

    def _report_step(self, engine: Engine) -> None:
        report = step_report(engine)
        for listener in self._listeners:
            try:
                listener(report)
            except Exception:  # noqa: BLE001
                logger.exception("step listener failed")

    @property
    def capacity(self) -> int | None:
        """Requests this engine takes at once (`capacity_of`)."""
        return capacity_of(self.config)

    @property
    def in_flight(self) -> int:
        """Streams open now: what `check_capacity` compares with `capacity`."""
        return len(self._streams)

    def check_capacity(self) -> None:
        """Raise QueueFullError when no more requests fit (`refuse_when_full`)."""
        refuse_when_full(len(self._streams), self.capacity)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        self._stopped.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout)

    # -- engine thread ------------------------------------------------------------------

    def _add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if request_id not in self._streams:
            return  # the caller left before we got here
        try:
            self.engine.add_request(request_id, prompt_ids, params, validated=True)
        except (ValueError, QueueFullError) as e:
            self._push(request_id, e)

    def _abort(self, request_id: str) -> None:
        req = self.engine.abort(request_id)
        if req is not None:
            self._push(request_id, stream_delta(req, [], True, self.detokenize))

    def _run(self, make: Callable[[], Engine] | None, built: Future) -> None:
        try:
            engine = self.engine if make is None else make()
        except BaseException as e:  # noqa: BLE001 - the constructor re-raises it
            built.set_exception(e)
            return
        self.engine = engine
        built.set_result(None)
        self._loop()

    def _loop(self) -> None:
        self._run_hooks()
        while not self._stopped.is_set():
            self._drain_commands(block=not self.engine.has_work)
            if self.engine.has_work and not self._stopped.is_set():
                self._step()
            self._run_hooks()

    def _step(self) -> None:
        updates, failed = step_for_streams(self.engine)
        for req, error in failed:
            self._push(req.request_id, error)
        # One wake-up per event loop per step, not one per request: each wake-up is a
        # syscall under the GIL, and a step can finish hundreds of tokens.
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for update in updates:
            req = update.req
            stream = self._streams.get(req.request_id)
            if stream is not None:
                if stream.wire:
                    delta = wire_update(req, update.new_tokens, update.finished)
                else:
                    delta = stream_delta(req, update.new_tokens, update.finished, self.detokenize)
                by_loop.setdefault(stream.loop, []).append((stream.put, delta))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(deliver, items)

    def _run_hooks(self) -> None:
        for hook in self._step_hooks:
            try:
                hook(self.engine)
            except Exception:  # noqa: BLE001
                logger.exception("step hook failed")

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                cmd()
            except Exception:  # noqa: BLE001
                logger.exception("engine command failed")
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _push(self, request_id: str, item: StreamDelta | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.put, item)
