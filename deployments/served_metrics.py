"""Every metric family the app's `GET /metrics` serves: one table, vLLM's names for what
both systems measure, `radixserve:` names for what is ours.

vLLM's names (`vllm:*`, with vLLM's `model_name` label) are what Grafana dashboards, KEDA and
HPA autoscalers and gateways read; a radixserve app answers them with the same meaning. Each
row says where its numbers come from in a replica's snapshot (deployments/scrape.py):

    stat      a key of the engine's `stats()` (counters and gauges, per engine replica)
    recorded  a catalogue metric of deployments/metric_catalogue.py, from the process's local copy
              (deployments/local_metrics.py): the same records as Ray's `ray_radixserve_*`
    router    a key of the prefix router's `router_stats()` (per ingress replica)

and which label names the replica: `engine` (vLLM's label for one engine of several) or
`ingress`. A row whose source a replica lacks (a stat the engine does not keep, speculative
decoding off) has no sample from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deployments import metric_catalogue as cat

ENGINE, INGRESS = "engine", "ingress"
STAT, RECORDED, ROUTER = "stat", "recorded", "router"
# vLLM's FinishReason values; our other outcomes (invalid, rejected, cancelled) are not
# successes and are counted by radixserve:engine_requests only.
VLLM_FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class Served:
    name: str  # as exposed; a counter's samples get `_total`
    kind: str  # "counter" | "gauge" | "histogram"
    help: str
    source: str  # STAT | RECORDED | ROUTER
    key: str  # the stat key, catalogue name or router counter
    role: str = ENGINE  # the label naming the replica: ENGINE or INGRESS
    tags: tuple[tuple[str, str], ...] = ()  # (recorded tag, exposed label)
    only: tuple[str, ...] = ()  # kept values of the first tag (empty: all)

    def series(self) -> tuple[str, ...]:
        """The sample names Prometheus stores for this family."""
        if self.kind == "counter":
            return (self.name + "_total",)
        if self.kind == "histogram":
            return tuple(self.name + s for s in ("_bucket", "_sum", "_count"))
        return (self.name,)


def _stat(name: str, kind: str, key: str, help: str) -> Served:
    return Served(name, kind, help, STAT, key)


def _recorded(name: str, key: str, help: str = "", role: str = ENGINE,
              tags: tuple[tuple[str, str], ...] = (), only: tuple[str, ...] = ()) -> Served:
    spec = cat.BY_NAME[key]
    return Served(name, spec.kind, help or spec.description, RECORDED, key, role, tags, only)


def _router(name: str, key: str, help: str) -> Served:
    return Served(name, "counter", help, ROUTER, key, INGRESS)


SERVED: tuple[Served, ...] = (
    # -- vLLM's names -----------------------------------------------------------------------
    _stat("vllm:num_requests_running", "gauge", "running",
          "Number of requests in model execution batches."),
    _stat("vllm:num_requests_waiting", "gauge", "waiting",
          "Number of requests waiting to be processed."),
    _stat("vllm:kv_cache_usage_perc", "gauge", "kv_usage",
          "KV-cache usage. 1 means 100 percent usage (slots held by running requests, the "
          "cached prefixes they lock included)."),
    _stat("vllm:prompt_tokens", "counter", "prompt_tokens",
          "Number of prefill tokens processed (admitted prompt tokens, cached ones included)."),
    _stat("vllm:generation_tokens", "counter", "generated_tokens",
          "Number of generation tokens processed."),
    _stat("vllm:prefix_cache_queries", "counter", "prompt_tokens",
          "Prefix cache queries, in terms of number of queried tokens."),
    _stat("vllm:prefix_cache_hits", "counter", "cached_tokens",
          "Prefix cache hits, in terms of number of cached tokens (found in the radix tree)."),
    _stat("vllm:num_preemptions", "counter", "preemptions",
          "Cumulative number of preemption from the engine (running requests retracted)."),
    _stat("vllm:spec_decode_num_drafts", "counter", "spec_steps",
          "Number of spec decoding drafts (request verifications that carried drafts)."),
    _stat("vllm:spec_decode_num_draft_tokens", "counter", "spec_drafted_tokens",
          "Number of draft tokens."),
    _stat("vllm:spec_decode_num_accepted_tokens", "counter", "spec_accepted_tokens",
          "Number of accepted tokens."),
    _recorded("vllm:request_success", cat.ENGINE_REQUESTS, "Count of successfully processed "
              "requests (engine calls: one per prompt and choice).",
              tags=(("finish_reason", "finished_reason"),), only=VLLM_FINISH_REASONS),
    _recorded("vllm:time_to_first_token_seconds", cat.TIME_TO_FIRST_TOKEN),
    _recorded("vllm:inter_token_latency_seconds", cat.INTER_TOKEN_LATENCY, "Inter-token latency "
              "in seconds: every token after the first, a delta's gap shared among its tokens."),
    _recorded("vllm:request_time_per_output_token_seconds", cat.TIME_PER_OUTPUT_TOKEN),
    _recorded("vllm:e2e_request_latency_seconds", cat.E2E_REQUEST_LATENCY),
    _recorded("vllm:request_queue_time_seconds", cat.QUEUE_TIME),
    _recorded("vllm:request_prefill_time_seconds", cat.PREFILL_TIME),
    _recorded("vllm:request_decode_time_seconds", cat.DECODE_TIME),
    _recorded("vllm:request_prompt_tokens", cat.REQUEST_PROMPT_LENGTH),
    _recorded("vllm:request_generation_tokens", cat.REQUEST_GENERATION_LENGTH),
    # -- ours -----------------------------------------------------------------------------
    _stat("radixserve:radix_cache_tokens", "gauge", "cached_slots",
          "Tokens held by the radix cache (shared prefixes kept for later requests)."),
    _stat("radixserve:radix_cache_evictable_tokens", "gauge", "evictable_slots",
          "Radix cache tokens no running request locks (evicted first when KV runs short)."),
    _stat("radixserve:kv_cache_slots", "gauge", "total_slots", "KV slots of the engine's pool."),
    _stat("radixserve:host_cache_hit_tokens", "counter", "host_cached_tokens",
          "Prompt tokens served from the cache that were loaded back from the host KV tier "
          "(part of vllm:prefix_cache_hits)."),
    _stat("radixserve:host_kv_cache_tokens", "gauge", "host_used_slots",
          "Tokens whose KV the host tier holds (host_kv_cache_gb; absent when it is off)."),
    _stat("radixserve:host_kv_load_bytes", "counter", "host_load_bytes",
          "KV bytes copied from the host tier back to the device."),
    _stat("radixserve:host_kv_write_back_bytes", "counter", "host_write_back_bytes",
          "KV bytes copied from the device to the host tier."),
    _stat("radixserve:host_kv_load_seconds", "counter", "host_load_seconds",
          "Time the host-to-device KV copies took (on their own stream: not step time)."),
    _stat("radixserve:host_kv_write_back_seconds", "counter", "host_write_back_seconds",
          "Time the device-to-host KV copies took (on their own stream: not step time)."),
    _stat("radixserve:prefix_fetches", "counter", "prefix_fetches",
          "Prompt prefixes this replica fetched from another replica's cache (through Ray's "
          "object store) instead of computing them."),
    _stat("radixserve:prefix_fetch_failures", "counter", "prefix_fetch_failures",
          "Prefix fetches that failed (holder gone, stopped, past the timeout): recomputed."),
    _stat("radixserve:prefix_fetched_tokens", "counter", "prefix_fetched_tokens",
          "Prompt tokens fetched from other replicas (prefill they skipped)."),
    _stat("radixserve:prefix_fetched_bytes", "counter", "prefix_fetched_bytes",
          "KV bytes fetched from other replicas."),
    _stat("radixserve:prefix_fetch_seconds", "counter", "prefix_fetch_seconds",
          "Time requests waited for prefix fetches, failed ones included."),
    _stat("radixserve:prefix_exports", "counter", "prefix_exports",
          "Prefixes this replica handed to other replicas."),
    _stat("radixserve:engine_steps", "counter", "steps", "Engine steps (forward passes)."),
    _stat("radixserve:queue_timeouts", "counter", "queue_timeouts",
          "Requests that waited in the engine's queue past their deadline and were ended "
          "unrun."),
    _stat("radixserve:priority_preemptions", "counter", "priority_preemptions",
          "Running requests retracted so that a waiting request of a higher priority (a lower "
          "value) could run; they resume later with unchanged outputs."),
    _stat("radixserve:lora_requests", "counter", "lora_requests",
          "Requests admitted under a LoRA adapter."),
    _stat("radixserve:lora_slot_hits", "counter", "lora_slot_hits",
          "Of the LoRA requests, those whose adapter was in the GPU pool already."),
    _stat("radixserve:lora_slot_loads", "counter", "lora_slot_loads",
          "LoRA adapters copied into a GPU pool slot (LRU eviction of an idle one)."),
    _stat("radixserve:lora_disk_loads", "counter", "lora_disk_loads",
          "LoRA adapters read from disk (registration, or after eviction from host memory)."),
    _stat("radixserve:lora_dynamic_loads", "counter", "lora_dynamic_loads",
          "LoRA adapters registered on first use from lora_dynamic_path."),
    _stat("radixserve:lora_adapters", "gauge", "lora_adapters", "LoRA adapters registered."),
    _recorded("radixserve:engine_requests", cat.ENGINE_REQUESTS, tags=(("finish_reason", "finish_reason"),)),
    _recorded("radixserve:batch_size", cat.BATCH_SIZE),
    _recorded("radixserve:grammar_compile_seconds", cat.GRAMMAR_COMPILE_TIME),
    _recorded("radixserve:http_requests", cat.HTTP_REQUESTS, role=INGRESS,
              tags=(("endpoint", "endpoint"), ("status", "status"))),
    _recorded("radixserve:http_request_duration_seconds", cat.HTTP_REQUEST_DURATION, role=INGRESS,
              tags=(("endpoint", "endpoint"),)),
    _recorded("radixserve:engine_calls_finished", cat.ENGINE_CALLS_FINISHED, role=INGRESS),
    _recorded("radixserve:finished_prompt_tokens", cat.PROMPT_TOKENS, role=INGRESS),
    _recorded("radixserve:finished_cached_tokens", cat.ACTUAL_CACHED_TOKENS, "Prompt tokens of "
              "finished engine calls that the serving replica found in its radix cache "
              "(compare radixserve:router_predicted_matched_tokens).", role=INGRESS),
    _router("radixserve:router_routed_with_match", "routed_with_match",
            "Engine calls routed to a replica believed to hold >= 1 block of the prompt."),
    _router("radixserve:router_routed_without_match", "routed_without_match",
            "Engine calls routed where no block was believed cached."),
    _router("radixserve:router_overflows", "overflows",
            "Engine calls whose prefix's first replica was past its load bound: sent to the "
            "next in the prefix's own ranking (every ingress computes the same)."),
    _router("radixserve:router_load_fallbacks", "load_fallbacks",
            "Routing decisions where every replica was past its bound: the least loaded."),
    _router("radixserve:router_misroutes", "misroutes",
            "Engine calls Serve sent elsewhere than the router's pick (the pick was full)."),
    _router("radixserve:router_digest_corrections", "digest_corrections",
            "Engine calls a replica's cache digest moved off the prefix's rendezvous first "
            "choice."),
    _router("radixserve:router_predicted_matched_tokens", "predicted_matched_tokens",
            "Prompt tokens the chosen replica's digest held at routing time."),
)
BY_SERVED_NAME: dict[str, Served] = {s.name: s for s in SERVED}
# Who answered the scrape, made by the scraping ingress itself (deployments/scrape.py).
SCRAPE_REPLICAS = "radixserve:scrape_replicas"
SCRAPE_REPLICAS_HELP = "Replicas whose series this scrape holds, by role (engine, ingress)."
SCRAPE_MISSING = "radixserve:scrape_replicas_missing"
SCRAPE_MISSING_HELP = ("Replicas that did not answer this scrape in time (their series are "
                       "absent from it), by role.")
COUNTER_STATS = tuple(sorted({s.key for s in SERVED if s.source == STAT and s.kind == "counter"}))


def served_series() -> set[str]:
    """Every sample name GET /metrics can serve."""
    return {name for s in SERVED for name in s.series()} | {SCRAPE_REPLICAS, SCRAPE_MISSING}


class StatHighWater:
    """Per replica: the engine's counters as never-decreasing numbers. The engine can take
    back an admission within a step, and a Prometheus counter that goes down reads as a
    restart (its whole value counted again by rate())."""

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}

    def __call__(self, stats: dict[str, Any]) -> dict[str, Any]:
        out = dict(stats)
        for key in COUNTER_STATS:
            if key in out:
                out[key] = self._seen[key] = max(self._seen.get(key, 0), out[key])
        return out
