"""Application metrics of radixserve (`ray.serve.metrics`; Ray adds the `deployment`,
`replica` and `application` tags and exports them with a `ray_` prefix).

The prefix-aware router counts what it *predicts* (`radixserve_router_predicted_matched_tokens`,
per routed engine call, in the process that holds the handle: the ingress). What the replica
*actually* found in its radix cache comes back with each engine call's last delta; the
ingress records it here, so predicted / actual can be compared per deployment:

    radixserve_engine_calls_finished   engine calls that ran to completion
    radixserve_prompt_tokens           their prompt tokens
    radixserve_actual_cached_tokens    their prompt tokens served from a replica's radix cache

Every metric's name is in deployments/metric_catalogue.py (`METRICS`). Here: the ingress
counters above, `MetricSet` (metrics made in the recording process, each record also kept
locally for /metrics), `HTTPMetricsMiddleware` (the ingress's HTTP requests) and the GC
pauses; deployments/engine_metrics.py records the engine replica's.

Recording is best effort: a metrics failure never breaks serving.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from deployments.local_metrics import LocalMetrics, process_metrics
from deployments.metric_catalogue import (
    ACTUAL_CACHED_TOKENS, BY_NAME, CLIENT_CLOSED, ENGINE_CALLS_FINISHED, GC_PAUSE, HTTP_REQUESTS,
    HTTP_REQUEST_DURATION, INGRESS_COUNTER_DESCRIPTIONS, PROMPT_TOKENS, MetricSpec,
)

if TYPE_CHECKING:  # (the engine's import pulls in torch; this module is read without it)
    from engine import WireDelta

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_counters: dict[str, Any] | None = None  # created on first use, inside a Ray worker


def _get_counters() -> dict[str, Any]:
    global _counters
    if _counters is None:
        with _lock:
            if _counters is None:
                made: dict[str, Any] = {}
                try:
                    from ray.serve import metrics

                    for name, description in INGRESS_COUNTER_DESCRIPTIONS.items():
                        made[name] = metrics.Counter(name, description=description)
                except Exception:  # noqa: BLE001 - e.g. not inside a Ray worker
                    logger.debug("radixserve metrics unavailable", exc_info=True)
                _counters = made
    return _counters


def _inc(name: str, value: float) -> None:
    counter = _get_counters().get(name)
    if counter is not None and value > 0:
        try:
            counter.inc(value)
        except Exception:  # noqa: BLE001
            logger.debug("could not record %s", name, exc_info=True)


def record_finished_engine_call(delta: WireDelta) -> None:
    """Record one engine call's final delta (`finished` true)."""
    for name, value in ((ENGINE_CALLS_FINISHED, 1), (PROMPT_TOKENS, delta.extra("prompt_tokens") or 0),
                        (ACTUAL_CACHED_TOKENS, delta.extra("cached_tokens") or 0)):
        if value > 0:
            process_metrics().inc(name, value)
        _inc(name, value)


# -- Making and recording metrics -------------------------------------------------------

MetricFactory = Callable[[MetricSpec], Any]


def ray_metric(spec: MetricSpec) -> Any:
    """A `ray.serve.metrics` object for `spec`; call it inside the replica that records it
    (Serve tags it with that replica's deployment, replica and application)."""
    from ray.serve import metrics

    tag_keys = spec.tag_keys or None
    if spec.kind == "counter":
        return metrics.Counter(spec.name, description=spec.description, tag_keys=tag_keys)
    if spec.kind == "gauge":
        return metrics.Gauge(spec.name, description=spec.description, tag_keys=tag_keys)
    return metrics.Histogram(spec.name, description=spec.description,
                             boundaries=list(spec.boundaries), tag_keys=tag_keys)


class MetricSet:
    """Some of the catalogue's metrics, made in the process that records them.

    Every record also goes to `local` (the process's own copy, which the app's `/metrics`
    serves: deployments/local_metrics.py). Best effort, like the rest of this module: a
    Ray metric that cannot be made (not in a Ray worker) is skipped, and a failed record is
    logged once, never raised.
    """

    def __init__(self, names: Iterable[str], factory: MetricFactory = ray_metric,
                 local: LocalMetrics | None = None) -> None:
        self._metrics: dict[str, Any] = {}
        self._warned = False
        self.local = local if local is not None else process_metrics()
        for name in names:
            try:
                self._metrics[name] = factory(BY_NAME[name])
            except Exception:  # noqa: BLE001
                logger.debug("metric %s unavailable", name, exc_info=True)

    def inc(self, name: str, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        if value > 0:
            self.local.inc(name, value, tags)
            self._record(name, "inc", value, tags)

    def set(self, name: str, value: float) -> None:
        self.local.set(name, value)
        self._record(name, "set", value, None)

    def observe(self, name: str, value: float, tags: dict[str, str] | None = None,
                local: bool = True) -> None:
        """`local=False`: Ray's metric only (the local copy is recorded otherwise)."""
        if local:
            self.local.observe(name, value, BY_NAME[name].boundaries, tags)
        self._record(name, "observe", value, tags)

    def _record(self, name: str, method: str, value: float, tags: dict[str, str] | None) -> None:
        metric = self._metrics.get(name)
        if metric is None:
            return
        try:
            if tags:
                getattr(metric, method)(value, tags=tags)
            else:
                getattr(metric, method)(value)
        except Exception:  # noqa: BLE001
            if not self._warned:
                self._warned = True
                logger.warning("could not record metric %s", name, exc_info=True)


# -- Ingress: HTTP requests -------------------------------------------------------------


class HTTPMetricsMiddleware:
    """ASGI middleware counting HTTP requests by endpoint and status, and timing them to
    the end of the response body (so a streamed completion counts its whole stream).

    The endpoint label is the matched route's path (bounded cardinality), else "other".
    Metric objects are made on the first request, i.e. inside the ingress replica.
    """

    def __init__(self, app: Any, factory: MetricFactory = ray_metric,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.app = app
        self._factory = factory
        self._clock = clock
        self._metrics: MetricSet | None = None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = self._clock()
        response: dict[str, Any] = {"status": None, "ended": False}

        async def watch(message: dict) -> None:
            if message["type"] == "http.response.start":
                response["status"] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                response["ended"] = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except asyncio.CancelledError:
            raise  # the client went away: counted as CLIENT_CLOSED
        except BaseException:
            if response["status"] is None:  # the outer error middleware will send a 500
                response.update(status=500, ended=True)
            raise
        finally:
            self._record(scope, response, self._clock() - start)

    def _record(self, scope: dict, response: dict[str, Any], elapsed: float) -> None:
        if self._metrics is None:
            self._metrics = MetricSet((HTTP_REQUESTS, HTTP_REQUEST_DURATION), self._factory)
        route = scope.get("route")
        endpoint = getattr(route, "path", None) or "other"
        status = str(response["status"]) if response["ended"] else CLIENT_CLOSED
        self._metrics.inc(HTTP_REQUESTS, 1, {"endpoint": endpoint, "status": status})
        self._metrics.observe(HTTP_REQUEST_DURATION, elapsed, {"endpoint": endpoint})


def install_http_metrics(api: Any) -> None:
    """Add the HTTP metrics middleware to the ingress's FastAPI app."""
    api.add_middleware(HTTPMetricsMiddleware)


# -- Either role ------------------------------------------------------------------------


class GCPauseMetrics:
    """Times this process's garbage collections of generation 1 and 2 into GC_PAUSE, from a
    `gc.callbacks` hook. (Generation 0 runs hundreds of times a second in well under a
    millisecond: not worth a metric call each.) A full collection stops every thread of the
    process, so its pause is a stall of the engine's steps or of the ingress's streams; the
    replicas freeze the GC after start-up to keep them short (engine/runtime/gc_freeze.py). A
    replica takes its process's one recorder from `record_gc_pauses()`; `close()` removes
    the hook."""

    def __init__(self, factory: MetricFactory = ray_metric,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.metrics = MetricSet([GC_PAUSE], factory)
        self._clock = clock
        self._started: float | None = None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        generation = info.get("generation", 0)
        if generation < 1:
            return
        if phase == "start":
            self._started = self._clock()
        elif self._started is not None:
            pause, self._started = self._clock() - self._started, None
            self.metrics.observe(GC_PAUSE, pause, tags={"generation": str(generation)})

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)


_gc_pauses: GCPauseMetrics | None = None


def record_gc_pauses() -> GCPauseMetrics:
    """The process's recorder, made by the first replica that asks (a process running
    several replicas, as tests do outside Serve, still times each collection once)."""
    global _gc_pauses
    with _lock:
        if _gc_pauses is None:
            _gc_pauses = GCPauseMetrics()
        return _gc_pauses
