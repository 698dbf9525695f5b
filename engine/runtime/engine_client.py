"""EngineClient: what a server holds of an engine, whichever transport carries it.

Two transports implement it: `AsyncEngine` (the step loop on a thread of this process)
and `ProcessAsyncEngine` (the step loop in a child process, with a GIL of its own). The
serving layer (deployments/engine_replica.py) types against this Protocol only;
tests/test_engine_client.py runs one contract suite against both, and
tests/test_engine_interface.py checks their signatures against it.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol, runtime_checkable

from engine.config import EngineConfig
from engine.core.outputs import StreamDelta, WireDelta
from engine.core.sampling_params import SamplingParams
from engine.core.queue_deadlines import QueueFullError
from engine.runtime.prefix_exchange import ExportedPrefix
from engine.runtime.step_report import StepReport

SHUTDOWN_TIMEOUT_S = 10.0

# `stream_to`'s consumer: StreamDeltas, or WireDeltas with `wire=True`.
DeltaSink = Callable[[StreamDelta], None] | Callable[[WireDelta], None]


@runtime_checkable
class EngineClient(Protocol):
    """An engine behind a transport, driven from asyncio. Requests are checked (prompt,
    limits, constraint, capacity) on the caller's side before anything is queued, and
    raise: ValueError (a request that can never run), QueueFullError (no room now),
    QueueTimeoutError, EngineStepError (a failed step ended it)."""

    config: EngineConfig

    def generate(self, prompt: str | list[int], params: SamplingParams,
                 request_id: str) -> AsyncIterator[StreamDelta]:
        """Stream one request's deltas; leaving the iteration early aborts it. Deltas
        queued behind a slow consumer come as one."""
        ...

    async def stream_to(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                        put: DeltaSink, wire: bool = False) -> None:
        """Run one request, handing each delta to `put` on the caller's event loop (in step
        order); return once it has finished. Cancelling the caller aborts the request."""
        ...

    async def abort(self, request_id: str) -> None:
        """Abort a request and wait until its KV slots are back in the pool; its stream
        ends with an "abort" delta."""
        ...

    async def stats(self) -> dict:
        """The engine's counters (`Engine.stats`)."""
        ...

    async def flush_cache(self) -> None:
        """Empty the radix cache between two steps."""
        ...

    async def export_prefix(self, tokens: list[int], skip: int = 0) -> ExportedPrefix | None:
        """`Engine.export_prefix` between steps: the KV of `tokens`' longest cached prefix
        past its first `skip` tokens (None without a host tier or a match past them)."""
        ...

    async def cached_length(self, tokens: list[int]) -> int:
        """`Engine.cached_length` between steps: the prompt's tokens cached in either tier."""
        ...

    async def import_prefix(self, prefix: ExportedPrefix) -> int:
        """`Engine.import_prefix` between steps: the tokens added to the host tier."""
        ...

    def add_step_listener(self, listener: Callable[[StepReport], None]) -> None:
        """Call `listener(report)` after every step and command batch, off the event loop."""
        ...

    @property
    def capacity(self) -> int | None:
        """Requests this engine takes at once (None: unbounded)."""
        ...

    @property
    def in_flight(self) -> int:
        """Streams open now: what `check_capacity` compares with `capacity`."""
        ...

    def check_capacity(self) -> None:
        """Raise QueueFullError when no more requests fit."""
        ...

    def is_alive(self) -> bool:
        ...

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stop the step loop (it finishes its step), waiting at most `timeout` seconds."""
        ...


def capacity_of(config: EngineConfig) -> int | None:
    """A full batch plus `max_queued_requests` waiting; None when the queue is unbounded."""
    limit = config.max_queued_requests
    return config.max_running_requests + limit if limit else None


def refuse_when_full(in_flight: int, capacity: int | None) -> None:
    """Counted on the caller's side (streams in flight), so a burst is refused at once,
    not after the engine has queued it."""
    if capacity is not None and in_flight >= capacity:
        raise QueueFullError(f"engine is at capacity ({capacity} requests in flight)")
