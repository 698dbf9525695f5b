"""The delta channel: one stream per (ingress replica, engine replica) for all their requests.

Through a Serve handle, each streamed item is its own Ray object, and a Serve replica moves
only a few thousand of them per second: one object per request per engine step caps a
replica at a fraction of the engine's tokens/s (scripts/bench_serve_path.py). So the token
deltas of every request an ingress replica has on an engine replica travel together: the
engine replica puts each step's deltas for one ingress into that ingress's `Outbox`, and the
channel call (a long-lived streaming call, routed to that exact replica) yields the whole
batch as one object.

Each request still has its own handle call: it is what the request router routes, what a
client disconnect cancels (aborting the request), and where errors come back. On a channel
it yields nothing else but one `ON_CHANNEL` marker. An ingress opens a channel to each engine
replica as its router learns of the replica (`ChannelHub._keep_open`); a request that reaches a
replica before that streams its deltas on its own call, led by an `{"open_channel": replica_id}`
item telling the ingress to open one now.

Each batch also carries the replica's streams in flight (after the batch: its finishing
streams are not counted) and capacity: the load report the ingress's admission gate reads
(deployments/admission.py).

A channel call counts as one of the replica's ongoing requests, to Serve. Two places must
not count it: Serve's graceful shutdown (a draining replica waits for its ongoing requests
to reach zero, and an open channel never ends by itself), and autoscaling
(deployments/autoscaling.py subtracts the channels the replica reports). So a draining
replica ends each channel once no request streams on it (`end_idle_channels_when_draining`).
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from engine import WireBatch, WireDelta
from router import ray_adapter

logger = logging.getLogger(__name__)

CHANNEL_OPEN_TIMEOUT_S = 10.0
KEEP_OPEN_PERIOD_S = 1.0  # how often an ingress looks for engine replicas it has no channel to
DRAIN_CHECK_PERIOD_S = 0.5  # how often a replica with channels asks whether it is draining

# The one item a request streaming on a channel yields on its own call, first. A Serve call
# must stream at least one item: over gRPC (RAY_SERVE_THROUGHPUT_OPTIMIZED=1, where replicas
# talk gRPC) the replica sends "accepted" as initial metadata, which gRPC need not deliver
# on a stream with no messages; the caller's router then fails the call with
# "RuntimeError: Unexpected error (StatusCode.OK)" (Serve itself sends a dummy message when
# it rejects a call, for the same reason).
ON_CHANNEL = {"on_channel": True}

# What a channel yields after its first item: (deltas, streams in flight, capacity or None).
ChannelBatch = tuple[WireBatch, int, int | None]


@dataclass
class ChannelOpen:
    """The argument of `EngineReplica.channel`: the request router sends it to `replica_id`."""

    ingress_id: str
    replica_id: str


class Outbox:
    """Replica side: deltas (WireDeltas) waiting for the channel's
    next yield (all on the replica's loop)."""

    def __init__(self) -> None:
        self._batch = WireBatch()
        self._ready = asyncio.Event()
        self.request_ids: set[str] = set()  # requests streaming through this channel
        self.closed = False
        self.ended = False  # the replica is draining: the channel call returns

    def end(self) -> None:
        self.ended = True
        self._ready.set()

    def put(self, delta: WireDelta) -> None:
        self._batch.append(delta)
        self._ready.set()

    async def take(self) -> WireBatch:
        await self._ready.wait()
        self._ready.clear()
        batch, self._batch = self._batch, WireBatch()
        return batch


def submit(method, arg):
    """`method.remote(arg)` under its own Serve-internal request id.

    Handle calls made while serving one HTTP request inherit that request's internal id,
    and Serve's router matches pending requests to chosen replicas by that id: with a
    router that is not FIFO (ours), sibling calls (n > 1, batched prompts) would take each
    other's replica assignment and one would wait forever. A fresh id per call, set in a
    copied context so the HTTP request's own context is untouched, keeps them apart.
    """
    def call():
        ray_adapter.set_fresh_request_id()
        return method.remote(arg)

    return contextvars.copy_context().run(call)


class ChannelHub:
    """Ingress side: this ingress replica's channels, and who waits for which request's
    deltas. `loads` (deployments/admission.py's AdmissionGate, or None) hears the replicas'
    load reports and every engine call's end."""

    def __init__(self, stream_handle, loads=None,
                 replicas: Callable[[], Iterable[str] | None] | None = None) -> None:
        self.ingress_id = uuid.uuid4().hex
        self._handle = stream_handle
        self._listeners: dict[str, Callable[[WireDelta], None]] = {}
        self._channels: dict[str, asyncio.Task] = {}
        self._ended: set[str] = set()  # replicas that ended our channel themselves (draining)
        self.loads = loads
        if replicas is not None:
            self._keeper = asyncio.ensure_future(self._keep_open(replicas))

    async def _keep_open(self, replicas: Callable[[], Iterable[str] | None]) -> None:
        """Open a channel to each engine replica in `replicas()` (None: not known yet) as it
        appears. A burst that arrives before its ingress has a channel on a replica would
        stream each of its requests on its own call, one Ray object per request per step,
        for as long as those requests run."""
        while True:
            known = set(replicas() or ())
            self._ended &= known
            for replica_id in known - self._ended:
                self._start(replica_id)
            await asyncio.sleep(KEEP_OPEN_PERIOD_S)

    def listen(self, request_id: str, on_delta: Callable[[WireDelta], None]) -> None:
        self._listeners[request_id] = on_delta

    def forget(self, request_id: str) -> None:
        self._listeners.pop(request_id, None)

    def open(self, replica_id: str) -> None:
        """Open a channel to `replica_id` (it asked for one) unless one is open or opening."""
        self._ended.discard(replica_id)
        self._start(replica_id)

    def _start(self, replica_id: str) -> None:
        if replica_id not in self._channels:
            # In a fresh context: called while serving one HTTP request, a task would inherit
            # that request's Ray task context, so the channel call became a child of that
            # request and was cancelled with it when its client disconnected, cutting every
            # other request streaming on the channel (seen in tests/test_autoscaling.py).
            self._channels[replica_id] = asyncio.create_task(
                self._pump(replica_id), context=contextvars.Context())

    async def _pump(self, replica_id: str) -> None:
        stream = submit(self._handle.channel, ChannelOpen(self.ingress_id, replica_id))
        try:
            # The router waits for that replica; if it is gone, give up (`_keep_open` tries
            # again while the router lists it).
            await asyncio.wait_for(stream.__anext__(), CHANNEL_OPEN_TIMEOUT_S)
            async for batch, in_flight, capacity in stream:
                for delta in batch:
                    listener = self._listeners.get(delta.request_id)
                    if listener is not None:
                        listener(delta)
                if self.loads is not None:  # after the deltas: it counts their ends
                    self.loads.report(replica_id, in_flight, capacity)
            self._ended.add(replica_id)  # a draining replica: reopening would delay its stop
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - its requests fail on their own calls
            logger.warning("delta channel to replica %s ended: %s", replica_id, type(e).__name__)
        finally:
            stream.cancel()
            self._channels.pop(replica_id, None)
            if self.loads is not None:
                self.loads.forget(replica_id)


def _no_load() -> tuple[int, int | None]:
    return 0, None


async def serve_channel(outboxes: dict[str, Outbox], replica_id: str, request: ChannelOpen,
                        abort: Callable[[str], None],
                        load: Callable[[], tuple[int, int | None]] = _no_load) -> AsyncIterator:
    """Replica side of one channel: yield batches (`ChannelBatch`, with `load()`'s streams
    in flight and capacity) until the ingress goes away."""
    outbox = Outbox()
    old = outboxes.get(request.ingress_id)
    outboxes[request.ingress_id] = outbox
    if old is not None:  # a reopened channel: the old one's requests lost their stream
        _close(old, abort)
    try:
        yield {"replica": replica_id}
        while True:
            batch = await outbox.take()
            if batch:
                in_flight, capacity = load()
                ending = sum(1 for delta in batch if delta.finished)  # may not have closed yet
                yield batch, max(0, in_flight - ending), capacity
            if outbox.ended and not outbox.request_ids:
                return  # the ingress's pump ends quietly; its requests here are all done
    finally:
        if outboxes.get(request.ingress_id) is outbox:
            del outboxes[request.ingress_id]
        _close(outbox, abort)


def _close(outbox: Outbox, abort: Callable[[str], None]) -> None:
    outbox.closed = True
    for request_id in list(outbox.request_ids):
        abort(request_id)


def replica_draining() -> bool:
    """Has Serve started this replica's graceful shutdown? Serve (2.60) has no public hook
    for it: read through Ray internals (router/ray_adapter.py; False outside Serve, so a
    newer Ray that moved them degrades to waiting out graceful_shutdown_timeout_s)."""
    return ray_adapter.replica_shutting_down()


async def end_idle_channels_when_draining(outboxes: dict[str, Outbox],
                                          draining: Callable[[], bool] = replica_draining) -> None:
    """Replica side, one task per replica: once draining, end every channel that has no
    request streaming on it (a channel still carrying requests ends after their last delta:
    `serve_channel` checks again after each batch). Serve then sees the replica idle and
    stops it, instead of waiting graceful_shutdown_timeout_s for channels that never end."""
    while not draining():
        await asyncio.sleep(DRAIN_CHECK_PERIOD_S)
    logger.info("replica draining: ending its delta channels as their requests finish")
    while True:
        # Again every period: a channel whose last request finished after its final batch
        # went out checks once more, and channels opened meanwhile end too.
        for outbox in list(outboxes.values()):
            outbox.end()
        await asyncio.sleep(DRAIN_CHECK_PERIOD_S)
