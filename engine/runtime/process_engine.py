"""ProcessAsyncEngine: AsyncEngine's serving API with the Engine and its step loop in a child
process (engine/runtime/engine_process_main.py), so the step loop has a GIL of its own.

In one process the engine thread shares the GIL with the server's event loop (request
intake, channel sends, Ray's threads); measured on the H200, that alone cost 6-8 points of
W2's throughput. Here the parent keeps only what the caller's side needs: validation (the
child's limits, reported at start-up, and a `Grammars` of its own for compile checks),
capacity counting, and the streams' callbacks. One reader thread takes the child's
messages (one per step) and wakes each event loop once per message.

Streams carry token ids only (as `AsyncEngine(detokenize=False)`): `generate` yields
StreamDeltas with empty text, `stream_to(..., wire=True)` hands over WireDeltas.
The parent never builds the model or touches CUDA; tp_size > 1 is not supported yet.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.core.admission import check_priority
from engine.runtime import engine_process_main as child
from engine.runtime.engine_process_main import EngineProcessError
from engine.config import EngineConfig
from engine.runtime.engine_client import SHUTDOWN_TIMEOUT_S, DeltaSink, capacity_of, refuse_when_full
from engine.runtime.loop_handoff import call_soon, deliver, set_exception, set_result
from engine.core.outputs import StreamDelta, WireDelta
from engine.runtime.prefix_exchange import ExportedPrefix
from engine.core.request import validate_request
from engine.core.sampling_params import SamplingParams
from engine.executor.startup_timer import process_age_s
from engine.runtime.step_report import StepReport
from engine.runtime.stream_deltas import WireToStreamDelta

if TYPE_CHECKING:
    from engine.runtime.engine import Engine

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    put: Callable[[WireDelta | BaseException], None]  # runs on `loop`
    seq: int  # this stream's number: deltas of an earlier stream with the same id are dropped


def _make_engine(config: EngineConfig) -> Engine:
    """What the child builds (it crosses by name): the engine's module is imported there,
    never in this process, which must start the child before torch loads."""
    from engine.runtime.engine import Engine

    logger.info("engine process: the engine's imports done, %.1fs after it started", process_age_s())
    return Engine(config)


class ProcessAsyncEngine:
    """The EngineClient (engine/runtime/engine_client.py) whose engine runs in a child."""

    def __init__(self, config: EngineConfig) -> None:
        if config.tp_size > 1:
            raise ValueError("the engine process does not support tp_size > 1 yet; "
                             "run the engine in the replica's process (engine_process: false)")
        self.config = config
        # The child first: this module imports nothing heavy, so the child starts as soon as
        # the caller's process can construct this; torch, transformers and the grammar
        # backends load here while the child loads the model.
        self._process, self._commands, self._out = child.start(config, _make_engine)
        try:
            import torch

            from engine.grammar import Grammars
            from engine.loading.tokenizer import Tokenizer

            self.tokenizer = Tokenizer(config.tokenizer or config.model)
            self.limits = child.wait_ready(self._process, self._out)
        except BaseException:
            child.kill(self._process)
            raise
        self.grammars = Grammars(config.grammar_backend, self.tokenizer.hf, self.limits.vocab_size,
                                 self.tokenizer.eos_token_ids, torch.device("cpu"),
                                 jump_forward=config.enable_jump_forward)
        self._streams: dict[str, _Stream] = {}
        self._replies: dict[int, asyncio.Future] = {}
        self._numbers = itertools.count(1)
        self._listeners: list[Callable[[StepReport], None]] = []
        self._dead = False
        self._stopping = False
        self._sendq: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="engine-process-sender", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="engine-process-reader", daemon=True)
        self._sender.start()
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    # -- requests -------------------------------------------------------------------------

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[StreamDelta]:
        """Stream deltas (token ids, no text) of one request; leaving early aborts it.
        Deltas queued behind a slow consumer come as one."""
        deltas: asyncio.Queue = asyncio.Queue()
        seq = await self._open(prompt, params, request_id, deltas.put_nowait)
        delta_of = WireToStreamDelta()
        finished = False
        pending = None  # an error that came behind deltas: raised after them
        try:
            while True:
                item = pending if pending is not None else await deltas.get()
                pending = None
                if isinstance(item, BaseException):
                    raise item
                delta = delta_of(item)
                while not delta.finished and not deltas.empty():
                    later = deltas.get_nowait()
                    if isinstance(later, BaseException):
                        pending = later
                        break
                    delta = delta.then(delta_of(later))
                finished = delta.finished
                yield delta
                if finished:
                    return
        finally:
            self._close(request_id, seq, finished)

    async def stream_to(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                        put: DeltaSink, wire: bool = False) -> None:
        """As AsyncEngine.stream_to: `put` gets each delta on the caller's loop (WireDeltas
        with `wire`, StreamDeltas without text otherwise); returns once finished."""
        done = asyncio.get_running_loop().create_future()
        delta_of = WireToStreamDelta()

        def take(item: WireDelta | BaseException) -> None:
            if done.done():
                return
            if isinstance(item, BaseException):
                done.set_exception(item)
                return
            put(item if wire else delta_of(item))
            if item.finished:
                done.set_result(None)

        seq = await self._open(prompt, params, request_id, take)
        finished = False
        try:
            await done
            finished = True
        finally:
            self._close(request_id, seq, finished)

    async def _open(self, prompt, params: SamplingParams, request_id: str,
                    put: Callable[[WireDelta | BaseException], None]) -> int:
        """Validate (here, with the child's limits), check capacity, queue the request."""
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if params.has_constraint:  # compile on the grammar pool, not on this event loop
            with contextlib.suppress(ValueError):  # check() raises it again, below
                await asyncio.wrap_future(self.grammars.submit(params))
        validate_request(prompt_ids, params, self.limits.vocab_size, self.limits.max_context,
                         self.limits.kv_slots)
        check_priority(params, self.config.priority_scheduling)
        self.grammars.check(params)
        self.check_capacity()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = next(self._numbers)
        self._streams[request_id] = _Stream(asyncio.get_running_loop(), put, seq)
        if self._dead:  # checked after registering: the reader fails every stream it sees
            del self._streams[request_id]
            raise self._gone_error()
        self._sendq.put(child.Add(request_id, seq, prompt_ids, params))
        return seq

    def _close(self, request_id: str, seq: int, finished: bool) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and stream.seq == seq:
            del self._streams[request_id]
        if not finished:
            self._sendq.put(child.Abort(request_id, seq))

    async def abort(self, request_id: str) -> None:
        """Abort a request and wait until its KV slots are back in the pool; its stream
        ends with an "abort" delta."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        await self._call(lambda reply: child.Abort(request_id, stream.seq, reply))

    async def stats(self) -> dict:
        return await self._call(lambda reply: child.Call("stats", reply))

    async def flush_cache(self) -> None:
        """`Engine.flush_cache` between steps."""
        await self._call(lambda reply: child.Call("flush_cache", reply))

    async def export_prefix(self, tokens: list[int], skip: int = 0) -> ExportedPrefix | None:
        return await self._call(lambda reply: child.Call("export_prefix", reply, (tokens, skip)))

    async def cached_length(self, tokens: list[int]) -> int:
        return await self._call(lambda reply: child.Call("cached_length", reply, (tokens,)))

    async def import_prefix(self, prefix: ExportedPrefix) -> int:
        return await self._call(lambda reply: child.Call("import_prefix", reply, (prefix,)))

    async def load_lora(self, name: str, path: str) -> None:
        await self._call(lambda reply: child.Call("load_lora", reply, (name, path)))

    async def unload_lora(self, name: str) -> None:
        await self._call(lambda reply: child.Call("unload_lora", reply, (name,)))

    async def list_loras(self) -> list[dict]:
        return await self._call(lambda reply: child.Call("list_loras", reply))

    async def _call(self, command: Callable[[int], child.Abort | child.Call]):
        fut = asyncio.get_running_loop().create_future()
        reply = next(self._numbers)
        self._replies[reply] = fut
        if self._dead:
            self._replies.pop(reply, None)
            raise self._gone_error()
        self._sendq.put(command(reply))
        return await fut

    def add_step_listener(self, listener: Callable[[StepReport], None]) -> None:
        """Call `listener(report)` after every step and command batch (on the reader thread)."""
        self._listeners.append(listener)

    # -- capacity, health, lifetime ---------------------------------------------------------

    @property
    def capacity(self) -> int | None:
        """Requests this engine takes at once (`capacity_of`)."""
        return capacity_of(self.config)

    @property
    def in_flight(self) -> int:  # streams open now: what check_capacity counts
        return len(self._streams)

    def check_capacity(self) -> None:
        """Raise QueueFullError when no more requests fit (streams in flight, counted here)."""
        refuse_when_full(len(self._streams), self.capacity)

    def is_alive(self) -> bool:
        return not self._dead and self._process.is_alive() and self._reader.is_alive()

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stop the child (it finishes its step), kill it if it does not exit in time."""
        if self._stopping:
            return
        self._stopping = True
        self._sendq.put(child.STOP)
        self._process.join(timeout)
        child.kill(self._process)
        self._reader.join(timeout=2)

    # -- the sender and reader threads -------------------------------------------------------

    def _send_loop(self) -> None:
        """Commands to the child, everything queued as one message (a burst of requests is
        one pipe write, and never blocks an event loop on a full pipe)."""
        while True:
            batch = [self._sendq.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    batch.append(self._sendq.get_nowait())
            try:
                self._commands.send(batch)
            except (OSError, ValueError):
                return  # the child is gone: the reader sees EOF and fails the streams
            if child.STOP in batch:
                return

    def _read_loop(self) -> None:
        try:
            while True:
                self._take(self._out.recv())
        except (EOFError, OSError):
            pass
        except Exception:  # noqa: BLE001
            logger.exception("engine process reader failed")
        finally:
            self._on_child_gone()

    def _take(self, message: child.StepMessage) -> None:
        """One step's deltas: one wake-up per event loop, then the listeners and replies."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        streams = self._streams
        for seq, delta in zip(message.delta_seqs, message.deltas):
            stream = streams.get(delta.request_id)
            if stream is not None and stream.seq == seq:
                by_loop.setdefault(stream.loop, []).append((stream.put, delta))
        for seq, error in message.errors:
            stream = self._stream_of(seq)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.put, error))
        for loop, items in by_loop.items():
            call_soon(loop, deliver, items)
        if message.report is not None:
            for listener in self._listeners:
                try:
                    listener(message.report)
                except Exception:  # noqa: BLE001
                    logger.exception("step listener failed")
        for reply, ok, value in message.replies:
            fut = self._replies.pop(reply, None)
            if fut is not None:
                call_soon(fut.get_loop(), set_result if ok else set_exception, fut, value)

    def _stream_of(self, seq: int) -> _Stream | None:
        """An error item's stream (errors are rare: a linear search is fine)."""
        return next((s for s in list(self._streams.values()) if s.seq == seq), None)

    def _on_child_gone(self) -> None:
        self._dead = True  # set first: _open and _call check it after registering
        self._process.join(1)
        error = self._gone_error()
        if not self._stopping:
            logger.error("%s", error)
        for stream in list(self._streams.values()):
            call_soon(stream.loop, stream.put, error)
        for fut in list(self._replies.values()):
            call_soon(fut.get_loop(), set_exception, fut, error)
        self._replies.clear()

    def _gone_error(self) -> EngineProcessError:
        if self._stopping:
            return EngineProcessError("the engine was shut down")
        return EngineProcessError(f"the engine process died (exit code {self._process.exitcode})")
