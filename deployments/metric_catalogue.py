"""The catalogue of every metric radixserve records through Ray (`ray.serve.metrics`): one
`MetricSpec` per metric, with where it is recorded. scripts/grafana_dashboard.py builds its
queries from these names and docs/monitoring.md's table from `METRICS`; the recording is in
deployments/metrics.py (the ingress) and deployments/engine_metrics.py (the engine replica)."""
from __future__ import annotations

from dataclasses import dataclass

# The ingress's counters of finished engine calls (deployments/metrics.py)
ENGINE_CALLS_FINISHED = "radixserve_engine_calls_finished"
PROMPT_TOKENS = "radixserve_prompt_tokens"
ACTUAL_CACHED_TOKENS = "radixserve_actual_cached_tokens"

INGRESS_COUNTER_DESCRIPTIONS = {
    ENGINE_CALLS_FINISHED: "Engine calls (one per prompt and choice) that finished.",
    PROMPT_TOKENS: "Prompt tokens of finished engine calls.",
    ACTUAL_CACHED_TOKENS: "Prompt tokens of finished engine calls that the serving replica "
                          "found in its radix cache (compare radixserve_router_predicted_matched_tokens).",
}

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
    _counter(ENGINE_CALLS_FINISHED, INGRESS_COUNTER_DESCRIPTIONS[ENGINE_CALLS_FINISHED], INGRESS),
    _counter(PROMPT_TOKENS, INGRESS_COUNTER_DESCRIPTIONS[PROMPT_TOKENS], INGRESS),
    _counter(ACTUAL_CACHED_TOKENS, INGRESS_COUNTER_DESCRIPTIONS[ACTUAL_CACHED_TOKENS], INGRESS),
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


