"""Application metrics of radixserve (`ray.serve.metrics`; Ray adds the `deployment`,
`replica` and `application` tags and exports them with a `ray_` prefix).

The prefix-aware router counts what it *predicts* (`radixserve_router_predicted_matched_tokens`,
per routed engine call, in the process that holds the handle: the ingress). What the replica
*actually* found in its radix cache comes back with each engine call's last delta; the
ingress records it here, so predicted / actual can be compared per deployment:

    radixserve_engine_calls_finished   engine calls that ran to completion
    radixserve_prompt_tokens           their prompt tokens
    radixserve_actual_cached_tokens    their prompt tokens served from a replica's radix cache

All metric names live in this module: `METRICS` is the catalogue (name, type, labels, who
records it), which scripts/grafana_dashboard.py turns into the Grafana dashboard and the
table of docs/monitoring.md. Besides the ingress counters above, `EngineMetrics` records the
engine replica's (step hook + per-call timing) and `HTTPMetricsMiddleware` the ingress's
HTTP requests.

Recording is best effort: a metrics failure never breaks serving.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deployments.local_metrics import LocalMetrics, process_metrics

if TYPE_CHECKING:  # (the engine's import pulls in torch; this module is read without it)
    from engine import WireDelta

logger = logging.getLogger(__name__)

ENGINE_CALLS_FINISHED = "radixserve_engine_calls_finished"
PROMPT_TOKENS = "radixserve_prompt_tokens"
ACTUAL_CACHED_TOKENS = "radixserve_actual_cached_tokens"

_DESCRIPTIONS = {
    ENGINE_CALLS_FINISHED: "Engine calls (one per prompt and choice) that finished.",
    PROMPT_TOKENS: "Prompt tokens of finished engine calls.",
    ACTUAL_CACHED_TOKENS: "Prompt tokens of finished engine calls that the serving replica "
                          "found in its radix cache (compare radixserve_router_predicted_matched_tokens).",
}

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

                    for name, description in _DESCRIPTIONS.items():
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


# -- The catalogue: every metric radixserve exports ---------------------------------------
#
# One `MetricSpec` per metric, with where it is recorded. `scripts/grafana_dashboard.py`
# builds its queries from these names and the tests check both stay in sync; docs/monitoring.md
# is the table for humans. Prometheus sees `ray_<name>` for gauges, `ray_<name>_total` for
# counters and `ray_<name>_bucket/_sum/_count` for histograms.

HTTP_REQUESTS = "radixserve_http_requests"
HTTP_REQUEST_DURATION = "radixserve_http_request_duration_seconds"
ENGINE_REQUESTS = "radixserve_engine_requests"
TIME_TO_FIRST_TOKEN = "radixserve_time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "radixserve_inter_token_latency_seconds"
E2E_REQUEST_LATENCY = "radixserve_e2e_request_latency_seconds"
QUEUE_TIME = "radixserve_queue_time_seconds"
PREFILL_TIME = "radixserve_prefill_time_seconds"
DECODE_TIME = "radixserve_decode_time_seconds"
TIME_PER_OUTPUT_TOKEN = "radixserve_time_per_output_token_seconds"
REQUEST_PROMPT_LENGTH = "radixserve_request_prompt_tokens"
REQUEST_GENERATION_LENGTH = "radixserve_request_generation_tokens"
GRAMMAR_COMPILE_TIME = "radixserve_grammar_compile_seconds"
ENGINE_PROMPT_TOKENS = "radixserve_engine_prompt_tokens"
ENGINE_CACHED_TOKENS = "radixserve_engine_cached_tokens"
ENGINE_GENERATED_TOKENS = "radixserve_engine_generated_tokens"
PREEMPTIONS = "radixserve_preemptions"
ENGINE_STEPS = "radixserve_engine_steps"
SPEC_VERIFY_STEPS = "radixserve_spec_verify_steps"
SPEC_DRAFTED_TOKENS = "radixserve_spec_drafted_tokens"
SPEC_ACCEPTED_TOKENS = "radixserve_spec_accepted_tokens"
BATCH_SIZE = "radixserve_batch_size"
NUM_RUNNING = "radixserve_num_running_requests"
NUM_WAITING = "radixserve_num_waiting_requests"
KV_CACHE_USAGE = "radixserve_kv_cache_usage"
RADIX_CACHE_TOKENS = "radixserve_radix_cache_tokens"
GC_PAUSE = "radixserve_gc_pause_seconds"
# Recorded by router/request_router.py (which may not import deployments/): its
# METRIC_PREFIX + _Counters.NAMES; a test checks these stay equal.
ROUTER_ROUTED_WITH_MATCH = "radixserve_router_routed_with_match"
ROUTER_ROUTED_WITHOUT_MATCH = "radixserve_router_routed_without_match"
ROUTER_LOAD_FALLBACKS = "radixserve_router_load_fallbacks"
ROUTER_OVERFLOWS = "radixserve_router_overflows"
ROUTER_MISROUTES = "radixserve_router_misroutes"
ROUTER_DIGEST_CORRECTIONS = "radixserve_router_digest_corrections"
ROUTER_PREDICTED_MATCHED_TOKENS = "radixserve_router_predicted_matched_tokens"

INGRESS, REPLICA, ROUTER = "ingress", "engine replica", "router (in the ingress)"
CLIENT_CLOSED = "499"  # HTTP status label when the client left before the response ended

# Up to 10 min (a long prompt queued behind long ones) and 1 h end to end (a long reasoning
# answer): past the last bound a sample only says "more", and quantiles flatten there.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
                600.0, 1200.0, 1800.0, 3600.0)
_LENGTH_BUCKETS = tuple(float(2 ** i) for i in range(18))  # 1 .. 131072 tokens
_COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_GC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# Ray exports a histogram's _sum as bucket midpoints times counts (not the observed values):
# half-integer bounds put small batch sizes at the exact midpoint of their own bucket.
_BATCH_BUCKETS = (0.5, 1.5, 2.5, 4.5, 8.5, 16.5, 32.5, 64.5, 128.5, 256.5, 512.5, 1024.5)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    description: str
    recorded_by: str
    tag_keys: tuple[str, ...] = ()
    boundaries: tuple[float, ...] = ()

    def series(self) -> tuple[str, ...]:
        """The Prometheus series names Ray exports for this metric."""
        base = "ray_" + self.name
        if self.kind == "counter":
            return (base + "_total",)
        if self.kind == "histogram":
            return (base + "_bucket", base + "_sum", base + "_count")
        return (base,)


def _counter(name: str, description: str, where: str, *tags: str) -> MetricSpec:
    return MetricSpec(name, "counter", description, where, tags)


def _gauge(name: str, description: str) -> MetricSpec:
    return MetricSpec(name, "gauge", description, REPLICA)


def _histogram(name: str, description: str, where: str, buckets: tuple[float, ...],
               *tags: str) -> MetricSpec:
    return MetricSpec(name, "histogram", description, where, tags, tuple(float(b) for b in buckets))


METRICS: tuple[MetricSpec, ...] = (
    # HTTP, per API request (the ingress's ASGI middleware).
    _counter(HTTP_REQUESTS, "HTTP requests by endpoint and status code (499: the client left "
             "before the response ended).", INGRESS, "endpoint", "status"),
    _histogram(HTTP_REQUEST_DURATION, "HTTP request duration, to the end of the (streamed) "
               "response body.", INGRESS, _E2E_BUCKETS, "endpoint"),
    # Engine calls (one per prompt and choice), timed on the replica that ran them.
    _counter(ENGINE_REQUESTS, "Engine calls by outcome: the finish reason (stop, length, "
             "abort, ...), `invalid` (400), `rejected` (queue full) or `cancelled`.",
             REPLICA, "finish_reason"),
    _histogram(TIME_TO_FIRST_TOKEN, "Time from the engine call reaching the replica to its "
               "first token.", REPLICA, _LATENCY_BUCKETS),
    _histogram(INTER_TOKEN_LATENCY, "Time between streamed deltas, per token.", REPLICA,
               _ITL_BUCKETS),
    _histogram(E2E_REQUEST_LATENCY, "Time from the engine call reaching the replica to its "
               "last token.", REPLICA, _E2E_BUCKETS),
    _histogram(QUEUE_TIME, "Time an engine call waited in the engine's queue before its "
               "first admission.", REPLICA, _LATENCY_BUCKETS),
    _histogram(PREFILL_TIME, "Time from first admission to the first token (prefill, "
               "chunked and cached included).", REPLICA, _LATENCY_BUCKETS),
    _histogram(DECODE_TIME, "Time from the first token to the last.", REPLICA, _E2E_BUCKETS),
    _histogram(TIME_PER_OUTPUT_TOKEN, "Per finished engine call: (last token - first token) "
               "/ (output tokens - 1).", REPLICA, _ITL_BUCKETS),
    _histogram(REQUEST_PROMPT_LENGTH, "Prompt tokens per finished engine call.", REPLICA,
               _LENGTH_BUCKETS),
    _histogram(REQUEST_GENERATION_LENGTH, "Output tokens per finished engine call.", REPLICA,
               _LENGTH_BUCKETS),
    _histogram(GRAMMAR_COMPILE_TIME, "Structured-output grammar compile time (cache misses "
               "only).", REPLICA, _COMPILE_BUCKETS),
    # The engine's own counters, folded in by the step hook.
    _counter(ENGINE_PROMPT_TOKENS, "Prompt tokens admitted by the engine.", REPLICA),
    _counter(ENGINE_CACHED_TOKENS, "Admitted prompt tokens found in the radix cache (cache "
             "hit rate = cached / prompt).", REPLICA),
    _counter(ENGINE_GENERATED_TOKENS, "Tokens sampled by the engine.", REPLICA),
    _counter(PREEMPTIONS, "Running requests retracted to free KV memory.", REPLICA),
    _counter(ENGINE_STEPS, "Engine steps (forward passes).", REPLICA),
    # Speculative decoding (engine/speculative/); zero when it is off.
    _counter(SPEC_VERIFY_STEPS, "Request verifications that carried draft tokens (each emits "
             "its accepted drafts plus one token of the target's).", REPLICA),
    _counter(SPEC_DRAFTED_TOKENS, "Draft tokens verified by the target.", REPLICA),
    _counter(SPEC_ACCEPTED_TOKENS, "Draft tokens the target accepted (acceptance rate = "
             "accepted / drafted; mean acceptance length = (accepted + verify steps) / "
             "verify steps).", REPLICA),
    _histogram(BATCH_SIZE, "Requests per engine step (running after the step plus those "
               "that finished in it).", REPLICA, _BATCH_BUCKETS),
    _gauge(NUM_RUNNING, "Requests being prefilled or decoded."),
    _gauge(NUM_WAITING, "Requests queued in the engine."),
    _gauge(KV_CACHE_USAGE, "Fraction of KV slots in use by running requests, including the "
           "cached prefixes they lock (unlocked radix cache counts as free), 0..1."),
    _gauge(RADIX_CACHE_TOKENS, "Tokens held by the radix cache."),
    # Either role's process (GCPauseMetrics below).
    _histogram(GC_PAUSE, "Python garbage collections of generation 1 and 2 (2: full) in the "
               "process: how long each stopped it (a replica's engine step loop, or every "
               "stream through an ingress).", f"{INGRESS}, {REPLICA}", _GC_BUCKETS, "generation"),
    # The ingress's view of finished engine calls (record_finished_engine_call above).
    _counter(ENGINE_CALLS_FINISHED, _DESCRIPTIONS[ENGINE_CALLS_FINISHED], INGRESS),
    _counter(PROMPT_TOKENS, _DESCRIPTIONS[PROMPT_TOKENS], INGRESS),
    _counter(ACTUAL_CACHED_TOKENS, _DESCRIPTIONS[ACTUAL_CACHED_TOKENS], INGRESS),
    # Routing decisions.
    _counter(ROUTER_ROUTED_WITH_MATCH, "Engine calls routed to a replica whose last cache "
             "digest held >= 1 block of the prompt.", ROUTER, "target_deployment"),
    _counter(ROUTER_ROUTED_WITHOUT_MATCH, "Engine calls routed where the replica's last digest "
             "held no block of the prompt.", ROUTER, "target_deployment"),
    _counter(ROUTER_OVERFLOWS, "Engine calls handed from the prefix's first choice, past its "
             "load bound, to the next replica in the prefix's ranking.", ROUTER, "target_deployment"),
    _counter(ROUTER_LOAD_FALLBACKS, "Engine calls sent to the least loaded replica because "
             "every replica was past its load bound.", ROUTER, "target_deployment"),
    _counter(ROUTER_MISROUTES, "Engine calls Serve sent to another replica than the router "
             "picked (the pick was full).", ROUTER, "target_deployment"),
    _counter(ROUTER_DIGEST_CORRECTIONS, "Engine calls moved off the prefix's rendezvous first "
             "choice to where a replica's digest showed the prefix lives.", ROUTER,
             "target_deployment"),
    _counter(ROUTER_PREDICTED_MATCHED_TOKENS, "Prompt tokens the chosen replica's last digest "
             "held.", ROUTER, "target_deployment"),
)
BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in METRICS}


def exported_series() -> set[str]:
    """Every Prometheus series name radixserve's metrics appear under."""
    return {series for spec in METRICS for series in spec.series()}


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


# -- Engine replica ---------------------------------------------------------------------

_STAT_COUNTERS = {  # engine.stats() key -> counter fed with its increase
    "prompt_tokens": ENGINE_PROMPT_TOKENS,
    "cached_tokens": ENGINE_CACHED_TOKENS,
    "generated_tokens": ENGINE_GENERATED_TOKENS,
    "preemptions": PREEMPTIONS,
    "steps": ENGINE_STEPS,
    "spec_steps": SPEC_VERIFY_STEPS,
    "spec_drafted_tokens": SPEC_DRAFTED_TOKENS,
    "spec_accepted_tokens": SPEC_ACCEPTED_TOKENS,
}
_STAT_GAUGES = {  # engine.stats() key -> gauge
    "running": NUM_RUNNING,
    "waiting": NUM_WAITING,
    "kv_usage": KV_CACHE_USAGE,
    "cached_slots": RADIX_CACHE_TOKENS,
}
_ITL_BOUNDS = BY_NAME[INTER_TOKEN_LATENCY].boundaries
_REQUEST_METRICS = (ENGINE_REQUESTS, TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, E2E_REQUEST_LATENCY,
                    QUEUE_TIME, PREFILL_TIME, DECODE_TIME, TIME_PER_OUTPUT_TOKEN,
                    REQUEST_PROMPT_LENGTH, REQUEST_GENERATION_LENGTH)


class EngineMetrics:
    """The metrics of one engine replica.

    `on_step(stats)` runs in the engine's step hook (engine thread, after every step and
    command batch, and at least every 0.5 s when idle) with the `engine.stats()` snapshot
    the replica takes anyway: it observes the batch size of each new step, and folds stat
    increases into counters and current values into gauges at most every
    `flush_interval_s` (Ray exports every few seconds; recording per step would only cost).
    `track_request()` times one engine call on the replica's event loop.
    """

    def __init__(self, factory: MetricFactory = ray_metric, flush_interval_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        names = [*_STAT_COUNTERS.values(), *_STAT_GAUGES.values(), BATCH_SIZE, GRAMMAR_COMPILE_TIME,
                 *_REQUEST_METRICS]
        self.metrics = MetricSet(names, factory)
        self._flush_interval_s = flush_interval_s
        self._clock = clock
        self._last_flush = -float("inf")
        # High-water marks: the engine can take back an admission within a step, and a
        # counter must never count the same tokens twice.
        self._counted = dict.fromkeys(_STAT_COUNTERS, 0)
        self._steps_seen = 0
        self._finished_seen = 0

    def on_step(self, stats: dict[str, Any]) -> None:
        self._observe_batch(stats)
        now = self._clock()
        if now - self._last_flush >= self._flush_interval_s:
            self._last_flush = now
            self._flush(stats)

    def _observe_batch(self, stats: dict[str, Any]) -> None:
        steps, finished = stats.get("steps", 0), stats.get("finished_requests", 0)
        if steps > self._steps_seen:
            # At most one step runs between two hook calls; requests that finished in it
            # have left `running` already.
            batch = stats.get("running", 0) + max(0, finished - self._finished_seen)
            self.metrics.observe(BATCH_SIZE, batch)
            self._steps_seen = steps
        self._finished_seen = finished

    def _flush(self, stats: dict[str, Any]) -> None:
        for key, name in _STAT_COUNTERS.items():
            value = stats.get(key, 0)
            if value > self._counted[key]:
                self.metrics.inc(name, value - self._counted[key])
                self._counted[key] = value
        for key, name in _STAT_GAUGES.items():
            if key in stats:
                self.metrics.set(name, stats[key])

    def on_grammar_compiles(self, seconds: list[float]) -> None:
        for s in seconds:
            self.metrics.observe(GRAMMAR_COMPILE_TIME, s)

    def track_request(self) -> RequestTimer:
        return RequestTimer(self.metrics, self._clock)


class RequestTimer:
    """Times one engine call from its arrival at the replica: TTFT at the first delta with
    tokens (split into queue and prefill time by the engine's queue time), inter-token
    latency; at the end: end-to-end latency, decode time, time per output token, prompt and
    output lengths, and the outcome.

    Inter-token latency is one sample per `itl_window_s` of a stream (the mean gap over the
    window), not one per delta: a Ray Histogram.observe costs tens of microseconds under
    the GIL the engine loop needs, and per delta it took 12% of a loaded replica's
    samples (py-spy, W2 on the H200). The process's local copy, which /metrics serves, takes
    every delta (a histogram update, ~0.4 us): vLLM's inter-token latency is per token, and
    a window's mean would hide its tail."""

    def __init__(self, metrics: MetricSet, clock: Callable[[], float], itl_window_s: float = 0.25) -> None:
        self._metrics = metrics
        self._token_gaps = metrics.local.histogram(INTER_TOKEN_LATENCY, _ITL_BOUNDS)
        self._clock = clock
        self._start = self._window_start = clock()
        self._window_tokens = 0
        self._itl_window_s = itl_window_s
        self._got_tokens = False
        self._first_token_at = self._last_delta_at = 0.0
        self._done = False

    def on_delta(self, num_tokens: int, finished: bool, finish_reason: str | None,
                 prompt_tokens: int = 0, completion_tokens: int = 0,
                 queue_time: float | None = None) -> None:
        now = self._clock()
        if num_tokens:
            if not self._got_tokens:
                self._first_token(now, queue_time)
                if num_tokens > 1:
                    # Tokens that came with the first reached the client with it: no gap.
                    self._token_gaps.observe(0.0, num_tokens - 1)
            else:
                # /metrics: every token after the first, its delta's gap shared among them.
                self._token_gaps.observe((now - self._last_delta_at) / num_tokens, num_tokens)
                self._window_tokens += num_tokens
                if now - self._window_start >= self._itl_window_s or finished:
                    self._metrics.observe(INTER_TOKEN_LATENCY,
                                          (now - self._window_start) / self._window_tokens, local=False)
                    self._window_start, self._window_tokens = now, 0
            self._last_delta_at = now
        if finished:
            self._metrics.observe(E2E_REQUEST_LATENCY, now - self._start)
            if self._got_tokens:
                self._finished(now, prompt_tokens, completion_tokens)
            self.close(finish_reason or "unknown")

    def _first_token(self, now: float, queue_time: float | None) -> None:
        ttft = now - self._start
        self._metrics.observe(TIME_TO_FIRST_TOKEN, ttft)
        if queue_time is not None:
            self._metrics.observe(QUEUE_TIME, queue_time)
            self._metrics.observe(PREFILL_TIME, max(0.0, ttft - queue_time))
        self._got_tokens = True
        self._first_token_at = self._window_start = now

    def _finished(self, now: float, prompt_tokens: int, completion_tokens: int) -> None:
        decode = now - self._first_token_at
        self._metrics.observe(DECODE_TIME, decode)
        if completion_tokens > 1:
            self._metrics.observe(TIME_PER_OUTPUT_TOKEN, decode / (completion_tokens - 1))
        if prompt_tokens:  # (0: the caller did not say)
            self._metrics.observe(REQUEST_PROMPT_LENGTH, prompt_tokens)
        if completion_tokens:
            self._metrics.observe(REQUEST_GENERATION_LENGTH, completion_tokens)

    def close(self, outcome: str = "cancelled") -> None:
        """Count the call once: with `outcome` unless it already finished."""
        if not self._done:
            self._done = True
            self._metrics.inc(ENGINE_REQUESTS, 1, {"finish_reason": outcome})


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
