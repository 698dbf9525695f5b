"""The engine replica: one AsyncEngine per Serve replica (or, with the `engine_process` app
arg, a ProcessAsyncEngine: the engine's step loop in a child process with its own GIL),
streaming token deltas back through the deployment handle, and publishing its load and
cache digest to the router."""
from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from deployments.channel import (
    ON_CHANNEL, ChannelOpen, Outbox, end_idle_channels_when_draining, serve_channel,
)
from deployments.errors import OVERLOADED_MESSAGE
from deployments.gc_thread import collect_on_own_thread
from deployments.local_metrics import process_metrics
from deployments.lora_registry import RestoredLoads, restore_adapters
from deployments.prefix_fetch import (
    DEFAULT_FETCH_TIMEOUT_S, PrefixFetch, PrefixFetcher, engine_handle,
)
from deployments.engine_metrics import EngineMetrics
from deployments.metrics import record_gc_pauses
from deployments.served_metrics import StatHighWater
from deployments.tp_workers import TPWorkers
# Only light names here (no torch, transformers or Triton: tests/test_startup_imports.py):
# this module is what Serve imports before the constructor starts the engine's process.
from engine import (
    EngineClient, EngineConfig, ExportedPrefix, QueueFullError, QueueTimeoutError,
    SamplingParams, StepReport, StreamDelta, WireDelta, ensure_demo_model, freeze_after_start,
    process_age_s, wire_of,
)
from router import ray_adapter
from router.cache_digest import CacheDigest

logger = logging.getLogger(__name__)


@dataclass
class EngineCall:
    """What the ingress sends to a replica for one choice.

    `prompt_token_ids` is what our router hashes; `prompt` (text) is what Ray's own
    PrefixCacheAffinityRouter reads. `params` were validated by the ingress, which built
    them; unpickling does not validate them again.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str = ""
    channel: str | None = None  # the calling ingress's id: deltas go on its channel if open
    # A replica holding more of the prompt, named by the request router: fetch it from there
    # (deployments/prefix_fetch.py)
    fetch_from: str | None = None


def resolve_model(model: str | None) -> str:
    return model or ensure_demo_model()


class EngineReplica:
    """Serve deployment class (wrapped with `serve.deployment` in `app.py`)."""

    def __init__(self, model: str | None, engine_kwargs: dict[str, Any],
                 digest_block_size: int = 16, gil_switch_interval_ms: float | None = None,
                 engine_process: bool = False,
                 prefix_fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S) -> None:
        logger.info("engine replica starting, %.1fs after its process started", process_age_s())
        collect_on_own_thread()  # never inside Serve's context-variable sets (gc_thread.py)
        if gil_switch_interval_ms is not None:
            sys.setswitchinterval(gil_switch_interval_ms / 1e3)
        config = EngineConfig(model=resolve_model(model), enable_cache_events=True, **engine_kwargs)
        self.tp_workers = None
        self.engine_process = engine_process
        self.engine: EngineClient = self._start_engine(config)
        # the app's runtime loads and unloads, before any request
        self.restored_loads = RestoredLoads(restore_adapters(self.engine))
        self.outboxes: dict[str, Outbox] = {}  # delta channels, by ingress id
        self._channel_waits: dict[str, asyncio.Future] = {}
        self._drain_watch: asyncio.Task | None = None  # started with the first channel
        self._requests_by_path = {"requests_on_channel": 0, "requests_on_own_stream": 0}
        self.digest = CacheDigest(block_size=digest_block_size)
        self._stats: dict[str, Any] = {}
        self._stats_lock = threading.Lock()
        self.metrics = EngineMetrics()  # here, not at import: metrics belong to the replica
        self._stat_high_water = StatHighWater()
        self.replica_id = _replica_id()
        self.engine.add_step_listener(self._after_step)
        self.prefixes = PrefixFetcher(self.engine, self.replica_id, engine_handle,
                                      prefix_fetch_timeout_s, ray_adapter.peer_replica_alive)
        # With the engine in this process its start-up froze the GC already; with it in a
        # child, this process forwards every delta and must not stop for full collections
        # either (engine/runtime/gc_freeze.py).
        if self.engine_process:
            freeze_after_start(self, config.freeze_gc_after_start)
        record_gc_pauses()  # this process's (the engine's too, unless a child's)
        logger.info("engine replica ready: %s, %.1fs after its process started", config.model,
                    process_age_s())

    def _start_engine(self, config: EngineConfig) -> EngineClient:
        """The engine, streaming token ids only: the ingress decodes text, off this process."""
        if self.engine_process:  # the model is built in the child; this process never touches CUDA
            from engine import ProcessAsyncEngine

            return ProcessAsyncEngine(config)
        from engine import AsyncEngine, Engine

        # At tp_size > 1 this replica is rank 0; the other ranks are Ray actors in its
        # placement group (deployments/tp_workers.py).
        self.tp_workers = TPWorkers(config) if config.tp_size > 1 else None
        tp = self.tp_workers.tp if self.tp_workers else None
        try:
            return AsyncEngine(config, make_engine=lambda: Engine(config, tp=tp), detokenize=False)
        except BaseException:
            if self.tp_workers is not None:  # the ranks may be inside a collective: no goodbye
                self.tp_workers.close(graceful=False)
            raise

    def _after_step(self, report: StepReport) -> None:
        """Runs after each step (on the engine thread, or the engine process's reader
        thread): fold cache events into the digest and snapshot the stats that routing and
        health checks read without a round trip."""
        self.digest.apply_all(report.cache_events)
        if report.stats is not None:  # None: unchanged since the last report
            with self._stats_lock:
                self._stats = report.stats
            self.metrics.on_step(report.stats)
        self.metrics.on_grammar_compiles(report.grammar_compile_times)

    async def generate(self, call: EngineCall) -> AsyncIterator[WireDelta | dict]:
        """Stream one request: WireDeltas here or on the caller's delta channel
        (deployments/channel.py), or one {"error": ..., "status": ...}."""
        from engine import LoRANotFoundError  # loaded with the engine (torch)

        timer = self.metrics.track_request()
        outbox = self.outboxes.get(call.channel) if call.channel else None
        try:
            path = "requests_on_channel" if outbox is not None else "requests_on_own_stream"
            self._requests_by_path[path] += 1
            if outbox is not None:
                yield ON_CHANNEL  # deltas go on the channel; this call must carry something
                await self._fetch_prefix(call)
                await self._generate_on_channel(call, outbox, timer)
                return
            if call.channel:
                yield {"open_channel": self.replica_id}
            await self._fetch_prefix(call)
            async for delta in self.engine.generate(call.prompt_token_ids, call.params,
                                                    call.request_id):
                _time_delta(timer, delta)
                yield wire_of(delta)  # token ids without text: the ingress decodes
        except ChannelClosed as e:
            timer.close("cancelled")
            yield {"error": str(e), "status": 503}
        except LoRANotFoundError as e:
            timer.close("invalid")
            yield {"error": str(e), "status": 404, "code": "model_not_found"}
        except ValueError as e:
            timer.close("invalid")
            yield {"error": str(e), "status": 400}
        except QueueTimeoutError as e:
            timer.close("queue_timeout")
            # The request's own limit: 408; the server's: 503, as when the queue is full.
            yield {"error": str(e), "status": 408 if e.by_request else 503, "code": "queue_timeout"}
        except QueueFullError:
            timer.close("rejected")
            # with this replica's load: the ingress's admission gate (deployments/admission.py)
            yield {"error": OVERLOADED_MESSAGE, "status": 503, "load": [self.replica_id, *self.load()]}
        finally:
            timer.close()  # no-op unless the caller left early

    async def _fetch_prefix(self, call: EngineCall) -> None:
        """The prompt's prefix from the replica the router named, if any (never raises but
        for cancellation: a failed fetch means the prefill computes it)."""
        await self.prefixes.fetch_for(call.fetch_from, call.prompt_token_ids, call.params)

    async def export_prefix(self, fetch: PrefixFetch) -> ExportedPrefix | None:
        """Another replica's fetch (deployments/prefix_fetch.py): this engine's longest
        cached prefix of `fetch.tokens`, returned through Ray's object store."""
        return await self.prefixes.export(fetch)

    async def _generate_on_channel(self, call: EngineCall, outbox: Outbox, timer) -> None:
        def put(delta: WireDelta) -> None:
            timer.on_delta(len(delta.token_ids), delta.finished, delta.finish_reason,
                           delta.extra("prompt_tokens", 0), delta.completion_tokens,
                           delta.extra("queue_time"))
            outbox.put(delta)

        run = asyncio.ensure_future(self.engine.stream_to(
            call.prompt_token_ids, call.params, call.request_id, put, wire=True))
        self._channel_waits[call.request_id] = run
        outbox.request_ids.add(call.request_id)
        try:
            await asyncio.shield(run)
        except asyncio.CancelledError:
            run.cancel()  # the client left (or the channel closed): abort in the engine
            if outbox.closed:
                raise ChannelClosed("the delta channel to the ingress closed") from None
            raise
        finally:
            outbox.request_ids.discard(call.request_id)
            self._channel_waits.pop(call.request_id, None)

    async def channel(self, request: ChannelOpen) -> AsyncIterator:
        """The delta channel of one ingress replica (deployments/channel.py)."""
        if self._drain_watch is None:
            self._drain_watch = asyncio.ensure_future(end_idle_channels_when_draining(self.outboxes))
        async for item in serve_channel(self.outboxes, self.replica_id, request, self._cut_off,
                                        self.load):
            yield item

    def load(self) -> tuple[int, int | None]:
        """(streams in flight, capacity or None): what the engine's admission compares."""
        return self.engine.in_flight, self.engine.capacity

    def _cut_off(self, request_id: str) -> None:
        """A request whose channel closed: its own call ends with an error."""
        run = self._channel_waits.get(request_id)
        if run is not None:
            run.cancel()

    async def stats(self) -> dict:
        """Engine stats, and how requests streamed (on a delta channel or their own call)."""
        return {**await self.engine.stats(), **self._requests_by_path,
                **self.prefixes.counters(), "open_channels": len(self.outboxes)}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics: the open delta channels, which Serve counts as
        ongoing requests and deployments/autoscaling.py takes back out."""
        return {"open_channels": float(len(self.outboxes))}

    async def metrics_snapshot(self) -> dict:
        """This replica's part of the app's /metrics (deployments/scrape.py)."""
        engine = {**await self.engine.stats(), **self.prefixes.counters()}
        return {"replica": self.replica_id, "engine": self._stat_high_water(engine),
                "recorded": process_metrics().snapshot()}

    async def replica_stats(self) -> dict:
        """This replica's id and stats (the ingress broadcasts it for /v1/stats)."""
        return {"replica": self.replica_id, "stats": await self.stats()}

    def tp_info(self) -> dict[str, Any]:
        """Where this replica's tensor-parallel ranks run: {"replica", "node_ids" (rank
        order, rank 0 = this replica), "workers" (the actor handles of ranks 1..tp-1)}."""
        import ray

        if self.tp_workers is None:
            return {"replica": self.replica_id, "workers": [],
                    "node_ids": [ray.get_runtime_context().get_node_id()]}
        return {"replica": self.replica_id, "node_ids": list(self.tp_workers.node_ids),
                "workers": list(self.tp_workers.actors)}

    async def flush_cache(self) -> None:
        await self.engine.flush_cache()

    async def lora_admin(self, op: str, *args: str) -> dict[str, Any]:
        """Run "load_lora" (name, path), "unload_lora" (name) or "list_loras" on this
        replica's engine: {"replica", "result"} or {"replica", "error", "status"}
        (broadcast to every replica by deployments/lora_api.py)."""
        from engine import LoRANotFoundError

        if op not in ("load_lora", "unload_lora", "list_loras"):
            return {"replica": self.replica_id, "error": f"unknown op {op!r}", "status": 400}
        if self.restored_loads.acknowledges(op, args):
            return {"replica": self.replica_id, "result": None}
        try:
            return {"replica": self.replica_id, "result": await getattr(self.engine, op)(*args)}
        except LoRANotFoundError as e:
            return {"replica": self.replica_id, "error": str(e), "status": 404}
        except ValueError as e:
            return {"replica": self.replica_id, "error": str(e), "status": 400}

    def record_routing_stats(self) -> dict[str, Any]:
        """Load and cache digest for every ingress's router (router/request_router.py); `ts`
        lets a router tell which of its own sends this load cannot show yet."""
        with self._stats_lock:
            stats = dict(self._stats)
        return {"cache_digest": self.digest.encode(), "num_running": stats.get("running", 0),
                "num_waiting": stats.get("waiting", 0), "kv_usage": stats.get("kv_usage", 0.0),
                "loras": stats.get("lora_in_gpu", []), "loras_cpu": stats.get("lora_in_cpu", []),
                "ts": time.time()}

    def check_health(self) -> None:
        if not self.engine.is_alive():
            raise RuntimeError("the engine loop has died" + (" (engine process)" if self.engine_process
                                                             else " (engine thread)"))
        if self.tp_workers is not None:
            self.tp_workers.check_health()  # a dead rank fails it: Serve restarts the replica

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        tp_workers = getattr(self, "tp_workers", None)
        if tp_workers is not None:
            tp_workers.close(graceful=engine is None or not engine.is_alive())


class ChannelClosed(RuntimeError):
    """The delta channel a request streamed on went away before the request finished."""


def _time_delta(timer, delta: StreamDelta) -> None:
    timer.on_delta(len(delta.token_ids), delta.finished, delta.finish_reason,
                   delta.prompt_tokens, delta.completion_tokens, delta.queue_time)


def _replica_id() -> str:
    """Serve's id of this replica (a placeholder outside Serve, e.g. in unit tests)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001
        return "local"
