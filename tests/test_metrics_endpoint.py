"""GET /metrics: the table of served names (vLLM's and ours), the process-local records behind
it, the Prometheus text it renders, and (slow) a real Prometheus scraping a running app of two
engine and two ingress replicas through the one URL clients use."""
from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deployments import metric_catalogue as cat
from deployments import engine_metrics
from deployments import metrics as m
from deployments.auth import KeyCheck
from deployments.local_metrics import LocalMetrics
from deployments.scrape import CONTENT_TYPE, app_snapshots, render
from deployments.served_metrics import (
    BY_SERVED_NAME, ENGINE, INGRESS, RECORDED, ROUTER, SCRAPE_MISSING, SCRAPE_REPLICAS, SERVED, STAT,
    StatHighWater, served_series,
)
from prometheus_helpers import (
    PROMETHEUS, SKIP_REASON, committed_config, promql, scalar, scrape_job, start_prometheus,
    stop_prometheus,
)
from serve_helpers import BASE, PORT, serve_config_args, start_ray, stop_ray, wait_until

# What the issue asks for, by vLLM's names (vllm/v1/metrics/loggers.py).
VLLM_NAMES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits", "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
}
# Engine stats that only some engines keep (speculative decoding, LoRA adapters, the host tier).
OPTIONAL_STATS = {"spec_steps", "spec_drafted_tokens", "spec_accepted_tokens", "lora_requests",
                  "lora_slot_hits", "lora_slot_loads", "lora_disk_loads", "lora_dynamic_loads",
                  "lora_adapters", "host_used_slots", "host_load_bytes", "host_write_back_bytes",
                  "host_load_seconds", "host_write_back_seconds"}


# -- The table ------------------------------------------------------------------------------


def test_table_has_vllms_names_and_ours_as_valid_prometheus_names():
    names = [s.name for s in SERVED]
    assert len(names) == len(set(names)) and VLLM_NAMES <= set(names)
    for s in SERVED:
        assert re.fullmatch(r"(vllm|radixserve):[a-z0-9_]+", s.name), s.name
        assert not s.name.endswith("_total") and s.help and s.role in (ENGINE, INGRESS)
        assert s.kind in ("counter", "gauge", "histogram")
        if s.source == RECORDED:  # the catalogue metric it reads, of the same type
            assert cat.BY_NAME[s.key].kind == s.kind
            assert {tag for tag, _ in s.tags} <= set(cat.BY_NAME[s.key].tag_keys)
        assert s.source != ROUTER or s.role == INGRESS
    assert {"radixserve:queue_timeouts", "vllm:num_preemptions",
            "radixserve:router_routed_with_match"} <= set(names)


def test_router_rows_read_the_routers_counters():
    from router import request_router

    keys = {s.key for s in SERVED if s.source == ROUTER}
    assert keys <= set(request_router._Counters.NAMES)


def test_metrics_is_open_without_an_api_key_like_vllms():
    check = KeyCheck()
    check.configure("secret", None)
    assert check.allows("/metrics", None) and not check.allows("/v1/models", None)


# -- Local records ----------------------------------------------------------------------------


def test_local_histograms_use_le_buckets_and_count_repeated_values():
    local = LocalMetrics()
    local.observe("h", 0.1, (0.1, 1.0))  # on a bound: that bound's bucket
    local.histogram("h", (0.1, 1.0)).observe(0.5, 3)  # three values at once
    local.observe("h", 7.0, (0.1, 1.0))
    local.inc("c", 2, {"k": "v"})
    local.inc("c", 1, {"k": "v"})
    snap = local.snapshot()
    assert snap["histograms"] == [["h", {}, [0.1, 1.0], [1, 3, 1], pytest.approx(8.6)]]
    assert snap["values"] == [["c", {"k": "v"}, 3.0]]


def test_request_timer_counts_every_token_after_the_first_for_vllms_itl():
    """The local inter-token latency is per token (vLLM's), while Ray's metric keeps one
    sample per 0.25 s window; TTFT, e2e and queue time count one per request."""
    local = LocalMetrics()
    names = [cat.TIME_TO_FIRST_TOKEN, cat.INTER_TOKEN_LATENCY, cat.E2E_REQUEST_LATENCY, cat.QUEUE_TIME,
             cat.PREFILL_TIME, cat.DECODE_TIME, cat.TIME_PER_OUTPUT_TOKEN, cat.ENGINE_REQUESTS]
    metrics = m.MetricSet(names, factory=lambda spec: None, local=local)  # no Ray metrics
    now = [0.0]
    timer = engine_metrics.RequestTimer(metrics, lambda: now[0])
    now[0] = 0.05
    timer.on_delta(1, False, None, queue_time=0.01)  # the first token
    now[0] = 0.06
    timer.on_delta(1, False, None)
    now[0] = 0.09
    timer.on_delta(3, False, None)  # three tokens after one 30 ms gap
    now[0] = 0.11
    timer.on_delta(1, True, "length", prompt_tokens=5, completion_tokens=6)
    hists = {n: (counts, total) for n, _, _, counts, total in local.snapshot()["histograms"]}
    itl_counts, itl_sum = hists[cat.INTER_TOKEN_LATENCY]
    assert sum(itl_counts) == 5 and itl_sum == pytest.approx(0.01 + 0.03 + 0.02)
    for name in (cat.TIME_TO_FIRST_TOKEN, cat.E2E_REQUEST_LATENCY, cat.QUEUE_TIME, cat.TIME_PER_OUTPUT_TOKEN):
        assert sum(hists[name][0]) == 1, name
    assert hists[cat.TIME_PER_OUTPUT_TOKEN][1] == pytest.approx(0.06 / 5)



def test_tokens_arriving_with_the_first_count_as_zero_gaps():
    """A first delta of several tokens (the engine's channel coalesced them under load):
    the tokens after the first reached the client with it, so each gets a zero gap and
    every token after the first still has one sample."""
    local = LocalMetrics()
    metrics = m.MetricSet([cat.TIME_TO_FIRST_TOKEN, cat.INTER_TOKEN_LATENCY, cat.E2E_REQUEST_LATENCY,
                           cat.DECODE_TIME, cat.TIME_PER_OUTPUT_TOKEN, cat.ENGINE_REQUESTS],
                          factory=lambda spec: None, local=local)
    now = [0.05]
    timer = engine_metrics.RequestTimer(metrics, lambda: now[0])
    timer.on_delta(3, False, None)
    now[0] = 0.07
    timer.on_delta(1, True, "length", completion_tokens=4)
    hists = {n: (counts, total) for n, _, _, counts, total in local.snapshot()["histograms"]}
    itl_counts, itl_sum = hists[cat.INTER_TOKEN_LATENCY]
    assert sum(itl_counts) == 3 and itl_sum == pytest.approx(0.02)
    assert itl_counts[0] == 2  # the two zero gaps, in the lowest bucket

def test_engine_counters_never_go_down_for_prometheus():
    high = StatHighWater()
    assert high({"prompt_tokens": 120, "running": 3})["prompt_tokens"] == 120
    taken_back = high({"prompt_tokens": 110, "running": 2})  # an admission taken back
    assert taken_back == {"prompt_tokens": 120, "running": 2}  # gauges follow the engine


# -- Rendering --------------------------------------------------------------------------------


def snapshot_of(replica: str, **parts) -> dict:
    return {"replica": replica, "recorded": {"values": [], "histograms": []}, **parts}


def test_render_keeps_each_replica_under_its_label_and_parses_as_prometheus_text():
    engine_stats = {"running": 2, "waiting": 1, "kv_usage": 0.25, "prompt_tokens": 100,
                    "cached_tokens": 40, "generated_tokens": 9}
    recorded = {"values": [[cat.ENGINE_REQUESTS, {"finish_reason": "length"}, 2.0],
                           [cat.ENGINE_REQUESTS, {"finish_reason": "rejected"}, 1.0]],
                "histograms": [[cat.TIME_TO_FIRST_TOKEN, {}, [0.1, 1.0], [1, 1, 0], 0.6]]}
    snaps = [snapshot_of("e1", engine=engine_stats, recorded=recorded),
             snapshot_of("e2", engine={**engine_stats, "running": 0}),
             snapshot_of("i1", router={"routed_with_match": 3, "routed_without_match": 1})]
    text = render(snaps, "demo", {INGRESS: (1, 0), ENGINE: (2, 1)}).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}

    def value(name, **labels):
        return samples[(name, tuple(sorted({"model_name": "demo", **labels}.items())))]

    assert value("vllm:num_requests_running", engine="e1") == 2
    assert value("vllm:num_requests_running", engine="e2") == 0
    assert value("vllm:prefix_cache_hits_total", engine="e1") == 40
    assert value("vllm:request_success_total", engine="e1", finished_reason="length") == 2
    assert not any(n == "vllm:request_success_total" and ("finished_reason", "rejected") in labels
                   for n, labels in samples)  # not a success, but an outcome of ours:
    assert value("radixserve:engine_requests_total", engine="e1", finish_reason="rejected") == 1
    assert value("vllm:time_to_first_token_seconds_bucket", engine="e1", le="1.0") == 2
    assert value("vllm:time_to_first_token_seconds_count", engine="e1") == 2
    assert value("radixserve:router_routed_with_match_total", ingress="i1") == 3
    assert value(SCRAPE_MISSING, role="engine") == 1 and value(SCRAPE_REPLICAS, role="engine") == 2
    assert "radixserve:queue_timeouts_total" not in text  # no engine keeps it here
    assert {name for name, _ in samples} <= served_series()


class Broadcast:
    """A deployment handle's broadcast, as Serve answers it: one result per replica, an
    exception for one that failed or timed out."""

    def __init__(self, results: list) -> None:
        self.results = results

    def broadcast(self, method: str):
        assert method == "metrics_snapshot"
        return self

    async def results_async(self, timeout_s=None, return_exceptions=False):
        assert return_exceptions and timeout_s
        return self.results


def test_app_snapshots_count_who_answered_by_role():
    async def own():
        return snapshot_of("me")

    assert asyncio.run(app_snapshots(own, None, None))[1] == {INGRESS: (1, 0), ENGINE: (0, 0)}
    peers = Broadcast([snapshot_of("i1"), snapshot_of("i2"), TimeoutError()])
    engines = Broadcast([snapshot_of("e1", engine={}), RuntimeError("replica died")])
    snaps, counts = asyncio.run(app_snapshots(own, peers, engines))
    assert [s["replica"] for s in snaps] == ["i1", "i2", "e1"]
    assert counts == {INGRESS: (2, 1), ENGINE: (1, 1)}


# -- A real Prometheus scraping a running app ---------------------------------------------------

API_KEY = "metrics-test-key"
MODEL = "radixserve-demo"
SENT = 6
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def scraped_app(tmp_path_factory):
    if PROMETHEUS is None:
        pytest.skip(SKIP_REASON)
    from ray import serve

    from deployments.app import build_app

    start_ray()
    prometheus = None
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        args = serve_config_args(num_replicas=2, ingress_replicas=2, api_key=API_KEY,
                                 ray_actor_options={"num_cpus": 0.1})
        serve.run(build_app(args), name="radixserve", route_prefix="/")
        config = committed_config()
        job = scrape_job(config, "radixserve")
        job["static_configs"] = [{"targets": [f"127.0.0.1:{PORT}"]}]
        config["scrape_configs"] = [job]
        prometheus, prom = start_prometheus(tmp_path_factory.mktemp("prometheus"), config)
        yield prom
    finally:
        if prometheus is not None:
            stop_prometheus(prometheus)
        stop_ray()


def send_traffic() -> tuple[int, int]:
    """SENT completions sharing a prefix, half streamed; one 400. Returns the usage's
    (prompt tokens, completion tokens), summed."""
    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    system = "You are a helpful assistant for the radixserve metrics test. " * 4
    prompt_tokens = completion_tokens = 0
    for i in range(SENT):
        kwargs = dict(model=MODEL, prompt=f"{system} Question {i}:", max_tokens=MAX_TOKENS,
                      temperature=0, extra_body={"ignore_eos": True})
        if i % 2:
            chunks = list(client.completions.create(**kwargs, stream=True,
                                                    stream_options={"include_usage": True}))
            usage = chunks[-1].usage
        else:
            usage = client.completions.create(**kwargs).usage
        prompt_tokens += usage.prompt_tokens
        completion_tokens += usage.completion_tokens
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    return prompt_tokens, completion_tokens


def total(prom: str, series: str, **labels: str) -> float | None:
    """The sum of `series` over every replica, of this model (and `labels`)."""
    selector = ",".join(f'{k}="{v}"' for k, v in {"model_name": MODEL, **labels}.items())
    return scalar(prom, f"sum({series}{{{selector}}})")


@pytest.mark.slow
def test_prometheus_scrapes_the_whole_app_from_one_url(scraped_app):
    prom = scraped_app
    reply = httpx.get(f"{BASE}/metrics", timeout=30)  # no key: open, as vLLM's
    assert reply.status_code == 200 and reply.headers["content-type"] == CONTENT_TYPE
    assert httpx.get(f"{BASE}/v1/models", timeout=30).status_code == 401
    prompt_tokens, completion_tokens = send_traffic()

    # Prometheus has every request once the end-to-end histogram counts them all.
    done = wait_until(lambda: total(prom, "vllm:e2e_request_latency_seconds_count") == SENT,
                      timeout=60, interval=1)
    assert done, promql(prom, "vllm:e2e_request_latency_seconds_count")
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
                      "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                      "vllm:request_time_per_output_token_seconds", "vllm:request_prompt_tokens",
                      "vllm:request_generation_tokens"):
        assert total(prom, f"{histogram}_count") == SENT, histogram
    assert total(prom, "vllm:request_success_total", finished_reason="length") == SENT
    # Every token after a request's first has an inter-token sample.
    assert total(prom, "vllm:inter_token_latency_seconds_count") == completion_tokens - SENT
    assert total(prom, "vllm:generation_tokens_total") == completion_tokens == SENT * MAX_TOKENS
    assert total(prom, "vllm:request_generation_tokens_sum") == completion_tokens
    assert total(prom, "vllm:prompt_tokens_total") == prompt_tokens
    assert total(prom, "vllm:request_prompt_tokens_sum") == prompt_tokens
    assert total(prom, "vllm:prefix_cache_queries_total") == prompt_tokens
    hits = total(prom, "vllm:prefix_cache_hits_total")
    assert 0 < hits < prompt_tokens  # the shared prefix, found after the first requests
    ttft_sum, e2e_sum = (total(prom, f"vllm:{h}_sum") for h in
                         ("time_to_first_token_seconds", "e2e_request_latency_seconds"))
    assert 0 < ttft_sum < e2e_sum < SENT * 60

    # Both engine replicas report, idle now; both ingress replicas' routers and HTTP counts
    # (every scrape is an HTTP request too) appear, whichever ingress answered the scrape.
    assert len(promql(prom, f'vllm:num_requests_running{{model_name="{MODEL}"}}')) == 2
    assert total(prom, "vllm:num_requests_running") == 0
    assert total(prom, "vllm:num_requests_waiting") == 0
    assert 0 <= scalar(prom, "max(vllm:kv_cache_usage_perc)") <= 1
    # with or without a match as the replicas' digests showed it when routed (a burst can
    # outrun the digests), every engine call is counted once
    routed = ("sum(radixserve:router_routed_with_match_total) + "
              "sum(radixserve:router_routed_without_match_total)")
    assert scalar(prom, routed) == SENT, promql(prom, "{__name__=~'radixserve:router_.*'}")
    both = wait_until(lambda: scalar(prom, "count(count by (ingress) (radixserve:http_requests_total))") == 2,
                      timeout=60, interval=1)
    assert both, promql(prom, "radixserve:http_requests_total")
    statuses = promql(prom, 'sum by (status) (radixserve:http_requests_total{endpoint="/v1/completions"})')
    assert {r["metric"]["status"] for r in statuses} == {"200", "400"}
    assert scalar(prom, f"max({SCRAPE_MISSING})") == 0
    assert scalar(prom, f'{SCRAPE_REPLICAS}{{role="engine"}}') == 2
    assert scalar(prom, f'{SCRAPE_REPLICAS}{{role="ingress"}}') == 2
    assert scalar(prom, 'up{job="radixserve"}') == 1


@pytest.mark.slow
def test_every_scrape_reports_the_same_engine_totals(scraped_app):
    """Whichever ingress replica answers, the engine side is the whole app's."""
    seen = set()
    for _ in range(6):
        text = httpx.get(f"{BASE}/metrics", timeout=30).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        prompt = sum(s.value for s in families["vllm:prompt_tokens"].samples)
        engines = {s.labels["engine"] for s in families["vllm:num_requests_running"].samples}
        seen.add((prompt, len(engines)))
        time.sleep(0.2)
    assert len(seen) == 1 and next(iter(seen))[1] == 2
    for name, served in BY_SERVED_NAME.items():  # every stat the engine keeps is served
        if served.source == STAT and served.key not in OPTIONAL_STATS:
            assert name in families, name
