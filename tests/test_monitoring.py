"""Monitoring: the metric catalogue, engine/HTTP recording, the /v1/stats summary, the
Grafana dashboard (generated, in sync, pushable), and a real Prometheus scraping Ray's
metrics export of a running app (slow)."""
from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import grafana_dashboard as gd  # noqa: E402
from deployments import metric_catalogue as cat  # noqa: E402
from deployments import engine_metrics  # noqa: E402
from deployments import metrics as m  # noqa: E402
from deployments.served_metrics import BY_SERVED_NAME, RECORDED, ROUTER, SERVED, STAT, served_series  # noqa: E402
from deployments.stats import aggregate, summary  # noqa: E402
from prometheus_helpers import (  # noqa: E402
    PROMETHEUS, SKIP_REASON, committed_config, promql, scrape_job, start_prometheus, stop_prometheus,
)
from serve_helpers import ROOT, end_ray, free_port, serve_config_args, wait_until  # noqa: E402

# -- The catalogue ----------------------------------------------------------------------


def test_catalogue_names_are_unique_prometheus_names():
    names = [spec.name for spec in cat.METRICS]
    assert len(names) == len(set(names))
    for spec in cat.METRICS:
        assert re.fullmatch(r"radixserve_[a-z0-9_]+", spec.name), spec.name
        assert spec.kind in ("counter", "gauge", "histogram")
        assert spec.description
        if spec.kind == "histogram":
            assert list(spec.boundaries) == sorted(spec.boundaries) and spec.boundaries[0] > 0


def test_router_metric_names_match_the_router():
    from router import request_router

    routers = {spec.name for spec in cat.METRICS if spec.name.startswith(request_router.METRIC_PREFIX)}
    assert routers == {request_router.METRIC_PREFIX + n for n in request_router._Counters.NAMES}


def test_series_names_follow_rays_export():
    assert cat.BY_NAME[cat.HTTP_REQUESTS].series() == ("ray_radixserve_http_requests_total",)
    assert cat.BY_NAME[cat.NUM_RUNNING].series() == ("ray_radixserve_num_running_requests",)
    assert cat.BY_NAME[cat.BATCH_SIZE].series() == (
        "ray_radixserve_batch_size_bucket", "ray_radixserve_batch_size_sum",
        "ray_radixserve_batch_size_count")


# -- Recording (fake metric objects) ----------------------------------------------------


class FakeMetric:
    def __init__(self, spec: cat.MetricSpec, log: list) -> None:
        self.name, self.log = spec.name, log

    def inc(self, value, tags=None):
        self.log.append((self.name, "inc", value, tags))

    def set(self, value, tags=None):
        self.log.append((self.name, "set", value, tags))

    def observe(self, value, tags=None):
        self.log.append((self.name, "observe", value, tags))


def fake_factory(log: list):
    return lambda spec: FakeMetric(spec, log)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stats_of(**kw) -> dict[str, Any]:
    base = dict(prompt_tokens=0, cached_tokens=0, generated_tokens=0, preemptions=0, steps=0,
                running=0, waiting=0, kv_usage=0.0, cached_slots=0, finished_requests=0)
    return {**base, **kw}


def test_gc_pauses_of_generations_1_and_2_are_timed_until_closed():
    import gc

    log: list = []
    enabled = gc.isenabled()
    gc.disable()  # only the collections below
    recorder = m.GCPauseMetrics(fake_factory(log))
    try:
        gc.collect()  # a full collection
        gc.collect(1)
        gc.collect(0)  # not recorded
    finally:
        recorder.close()
        gc.collect()  # after close(): not recorded
        if enabled:
            gc.enable()
    pauses = [(tags["generation"], v) for n, op, v, tags in log if n == cat.GC_PAUSE]
    assert [g for g, _ in pauses] == ["2", "1"]
    assert all(op == "observe" for n, op, _, _ in log) and all(0 < v < 60 for _, v in pauses)


def test_engine_metrics_fold_stats_into_counters_gauges_and_batch_sizes():
    log: list = []
    em = engine_metrics.EngineMetrics(fake_factory(log), flush_interval_s=0.0)
    em.on_step(stats_of(prompt_tokens=100, cached_tokens=40, steps=1, running=3, waiting=2, kv_usage=0.5))
    em.on_step(stats_of(prompt_tokens=120, cached_tokens=40, steps=2, running=2, finished_requests=1))
    em.on_step(stats_of(prompt_tokens=110, cached_tokens=40, steps=2, running=2, finished_requests=1))
    em.on_step(stats_of(prompt_tokens=130, cached_tokens=50, steps=2, running=2, finished_requests=1))

    incs = [(n, v) for n, op, v, _ in log if op == "inc"]
    assert incs == [(cat.ENGINE_PROMPT_TOKENS, 100), (cat.ENGINE_CACHED_TOKENS, 40), (cat.ENGINE_STEPS, 1),
                    (cat.ENGINE_PROMPT_TOKENS, 20), (cat.ENGINE_STEPS, 1),
                    # 110 < 120 already counted (an admission taken back): only 130 - 120
                    (cat.ENGINE_PROMPT_TOKENS, 10), (cat.ENGINE_CACHED_TOKENS, 10)]
    batches = [v for n, op, v, _ in log if n == cat.BATCH_SIZE]
    assert batches == [3, 3]  # step 2: two still running + one that finished in it
    gauges = [(n, v) for n, op, v, _ in log if op == "set"][:4]
    assert gauges == [(cat.NUM_RUNNING, 3), (cat.NUM_WAITING, 2), (cat.KV_CACHE_USAGE, 0.5),
                      (cat.RADIX_CACHE_TOKENS, 0)]


def test_engine_metrics_count_speculative_decoding():
    """The engine's speculative counters (engine.stats() spec_*) feed three counters, from
    which the dashboard computes the acceptance rate and length; absent when it is off."""
    log: list = []
    em = engine_metrics.EngineMetrics(fake_factory(log), flush_interval_s=0.0)
    em.on_step(stats_of(steps=1))
    em.on_step(stats_of(steps=2, spec_steps=3, spec_drafted_tokens=12, spec_accepted_tokens=7))
    em.on_step(stats_of(steps=3, spec_steps=5, spec_drafted_tokens=20, spec_accepted_tokens=9))
    incs = [(n, v) for n, op, v, _ in log if op == "inc" and n != cat.ENGINE_STEPS]
    assert incs == [(cat.SPEC_VERIFY_STEPS, 3), (cat.SPEC_DRAFTED_TOKENS, 12), (cat.SPEC_ACCEPTED_TOKENS, 7),
                    (cat.SPEC_VERIFY_STEPS, 2), (cat.SPEC_DRAFTED_TOKENS, 8), (cat.SPEC_ACCEPTED_TOKENS, 2)]


def test_engine_metrics_flush_at_most_once_per_interval():
    log: list = []
    clock = Clock()
    em = engine_metrics.EngineMetrics(fake_factory(log), flush_interval_s=1.0, clock=clock)
    em.on_step(stats_of(prompt_tokens=10, steps=1, running=1))
    clock.now += 0.1
    em.on_step(stats_of(prompt_tokens=20, steps=2, running=1))
    assert [v for n, op, v, _ in log if n == cat.ENGINE_PROMPT_TOKENS] == [10]
    assert [v for n, op, v, _ in log if n == cat.BATCH_SIZE] == [1, 1]  # every step
    clock.now += 1.0
    em.on_step(stats_of(prompt_tokens=20, steps=2, running=0))
    assert [v for n, op, v, _ in log if n == cat.ENGINE_PROMPT_TOKENS] == [10, 10]


def test_request_timer_records_ttft_itl_e2e_and_one_outcome():
    log: list = []
    clock = Clock()
    em = engine_metrics.EngineMetrics(fake_factory(log), clock=clock)
    timer = em.track_request()
    clock.now += 0.5
    timer.on_delta(1, False, None)
    clock.now += 0.2
    timer.on_delta(2, False, None)
    clock.now += 0.1
    timer.on_delta(1, True, "length")
    timer.close()
    got = [(n, round(v, 6), t) for n, op, v, t in log]
    # one inter-token sample for the window (0.3 s >= 0.25 s): the mean gap of its 3 tokens
    assert got == [(cat.TIME_TO_FIRST_TOKEN, 0.5, None), (cat.INTER_TOKEN_LATENCY, 0.1, None),
                   (cat.E2E_REQUEST_LATENCY, 0.8, None), (cat.DECODE_TIME, 0.3, None),
                   (cat.ENGINE_REQUESTS, 1, {"finish_reason": "length"})]
    log.clear()
    busy = em.track_request()
    busy.on_delta(1, False, None)  # TTFT at 0
    for _ in range(20):  # 20 deltas in 0.2 s: within one window, no sample yet
        clock.now += 0.01
        busy.on_delta(1, False, None)
    assert [n for n, *_ in log] == [cat.TIME_TO_FIRST_TOKEN]
    clock.now += 0.1
    busy.on_delta(4, False, None)
    assert [(n, round(v, 6)) for n, _, v, _ in log[1:]] == [(cat.INTER_TOKEN_LATENCY, round(0.3 / 24, 6))]
    log.clear()
    left = em.track_request()
    left.close()
    left.close()
    assert log == [(cat.ENGINE_REQUESTS, "inc", 1, {"finish_reason": "cancelled"})]


def test_request_timer_splits_phases_and_records_lengths():
    """Queue time comes from the engine; prefill is the rest of TTFT; decode and time per
    output token run from the first token to the last; lengths at the end."""
    log: list = []
    clock = Clock()
    em = engine_metrics.EngineMetrics(fake_factory(log), clock=clock)
    timer = em.track_request()
    clock.now += 0.5
    timer.on_delta(1, False, None, prompt_tokens=40, completion_tokens=1, queue_time=0.2)
    clock.now += 0.9
    timer.on_delta(9, True, "stop", prompt_tokens=40, completion_tokens=10)
    got = {n: round(v, 6) for n, op, v, _ in log if op == "observe"}
    assert got[cat.QUEUE_TIME] == 0.2 and got[cat.PREFILL_TIME] == 0.3
    assert got[cat.DECODE_TIME] == 0.9 and got[cat.TIME_PER_OUTPUT_TOKEN] == 0.1
    assert got[cat.REQUEST_PROMPT_LENGTH] == 40 and got[cat.REQUEST_GENERATION_LENGTH] == 10
    log.clear()
    em.on_grammar_compiles([0.05, 0.2])
    assert [(n, v) for n, _, v, _ in log] == [(cat.GRAMMAR_COMPILE_TIME, 0.05), (cat.GRAMMAR_COMPILE_TIME, 0.2)]


def test_long_requests_do_not_overflow_the_latency_buckets():
    assert cat.BY_NAME[cat.E2E_REQUEST_LATENCY].boundaries[-1] >= 3600
    assert cat.BY_NAME[cat.HTTP_REQUEST_DURATION].boundaries[-1] >= 3600
    assert cat.BY_NAME[cat.TIME_TO_FIRST_TOKEN].boundaries[-1] >= 300


def test_metrics_never_break_the_caller():
    def broken_factory(spec):
        if spec.kind == "gauge":
            raise RuntimeError("no Ray here")
        return object()  # has no inc/observe: recording fails

    em = engine_metrics.EngineMetrics(broken_factory)
    em.on_step(stats_of(prompt_tokens=5, steps=1, running=1))
    em.track_request().on_delta(1, True, "stop")


def http_app():
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import StreamingResponse

    api = FastAPI()

    @api.get("/ok")
    async def ok():
        return {"ok": True}

    @api.get("/bad")
    async def bad():
        raise HTTPException(400, "no")

    @api.get("/stream")
    async def stream():
        async def chunks():
            for i in range(3):
                yield f"data: {i}\n\n"
        return StreamingResponse(chunks(), media_type="text/event-stream")

    return api


def test_http_middleware_counts_by_endpoint_and_status():
    log: list = []
    api = http_app()
    api.add_middleware(m.HTTPMetricsMiddleware, factory=fake_factory(log))

    async def run() -> None:
        transport = httpx.ASGITransport(app=api)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.get("/ok")).status_code == 200
            assert (await client.get("/bad")).status_code == 400
            assert (await client.get("/stream")).text.count("data:") == 3
            assert (await client.get("/missing")).status_code == 404

    asyncio.run(run())
    counted = [t for n, op, v, t in log if n == cat.HTTP_REQUESTS]
    assert counted == [{"endpoint": "/ok", "status": "200"}, {"endpoint": "/bad", "status": "400"},
                       {"endpoint": "/stream", "status": "200"}, {"endpoint": "other", "status": "404"}]
    assert len([1 for n, *_ in log if n == cat.HTTP_REQUEST_DURATION]) == 4


def test_http_middleware_counts_a_client_that_left_as_499():
    log: list = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"x", "more_body": True})
        raise asyncio.CancelledError  # what Serve does when the client disconnects

    async def noop(message):
        pass

    middleware = m.HTTPMetricsMiddleware(app, factory=fake_factory(log))
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(middleware({"type": "http", "path": "/x"}, None, noop))
    assert log[0] == (cat.HTTP_REQUESTS, "inc", 1, {"endpoint": "other", "status": cat.CLIENT_CLOSED})


# -- /v1/stats summary ------------------------------------------------------------------


def replica(prompt, cached, free, evictable, total, running) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "cached_tokens": cached, "free_slots": free,
            "evictable_slots": evictable, "total_slots": total, "running": running,
            "cache_hit_rate": cached / prompt, "kv_usage": 0.123}


def test_aggregate_sums_counts_and_recomputes_ratios():
    total = aggregate({"a": replica(100, 50, 10, 10, 100, 2), "b": replica(300, 50, 50, 30, 100, 1)})
    assert total["prompt_tokens"] == 400 and total["running"] == 3 and total["total_slots"] == 200
    assert total["cache_hit_rate"] == pytest.approx(100 / 400)
    assert total["kv_usage"] == pytest.approx(1 - 100 / 200)
    assert aggregate({})["cache_hit_rate"] == 0.0


class FakeBroadcast:
    def __init__(self, results) -> None:
        self.results = results

    async def results_async(self, timeout_s=None, return_exceptions=False):
        return self.results


class FakeRouter:
    def router_stats(self):
        return {"routed_with_match": 3}


class FakeHandle:
    def __init__(self, results) -> None:
        self.results = results
        self._router = type("R", (), {"_asyncio_router": type("A", (), {"request_router": FakeRouter()})()})()

    def broadcast(self, method):
        assert method == "replica_stats"
        return FakeBroadcast(self.results)


def test_summary_merges_replicas_and_router_counters():
    results = [{"replica": "a", "stats": replica(100, 50, 10, 10, 100, 2)},
               {"replica": "b", "stats": replica(100, 0, 10, 10, 100, 0)}, TimeoutError()]
    out = asyncio.run(summary(FakeHandle(results)))
    assert out["num_replicas"] == 2 and out["replicas_not_answering"] == 1
    assert set(out["replicas"]) == {"a", "b"} and out["running"] == 2
    assert out["router"] == {"routed_with_match": 3, "ingress_replicas": 1}


class FakeIngressHandle:
    def __init__(self, parts: list) -> None:
        self.parts = parts

    def broadcast(self, method: str) -> FakeBroadcast:
        assert method == "router_counters"
        return FakeBroadcast(self.parts)


def test_summary_sums_router_counters_over_ingress_replicas():
    results = [{"replica": "a", "stats": replica(100, 50, 10, 10, 100, 2)}]
    parts = [{"routed_with_match": 3, "overflows": 1, "replicas_tracked": 2, "blocks_tracked": 9},
             {"routed_with_match": 4, "overflows": 0, "replicas_tracked": 2, "blocks_tracked": 7},
             None, TimeoutError()]  # colocated (no router), and one that did not answer
    out = asyncio.run(summary(FakeHandle(results), FakeIngressHandle(parts)))
    assert out["router"] == {"routed_with_match": 7, "overflows": 1, "replicas_tracked": 2,
                             "blocks_tracked": 9, "ingress_replicas": 2}
    assert "router" not in asyncio.run(summary(FakeHandle(results), FakeIngressHandle([None])))


# -- Grafana dashboard ------------------------------------------------------------------


def dashboard_exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_committed_dashboard_is_what_the_script_generates():
    assert gd.DASHBOARD_PATH.read_text() == gd.render(gd.build_dashboard()), \
        "run: python scripts/grafana_dashboard.py"


def test_every_query_names_a_served_metric_and_every_metric_is_shown():
    """Queries read the app's /metrics (vllm:*, radixserve:*) and, for what only Ray exports,
    Ray's series; every /metrics family is on the dashboard, and every catalogue metric is,
    through the /metrics family that serves its numbers or its own Ray series."""
    dashboard = json.loads(gd.DASHBOARD_PATH.read_text())
    known = cat.exported_series() | served_series()
    used: set[str] = set()
    queries = dashboard_exprs(dashboard) + [
        v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    for expr in queries:
        names = set(re.findall(r"\b(?:ray_|vllm:|radixserve:)[a-zA-Z0-9_:]+", expr))
        assert names and names <= known, (expr, names - known)
        used |= names
    shown_served = {s.name for s in SERVED if used & set(s.series())}
    assert shown_served == set(BY_SERVED_NAME), set(BY_SERVED_NAME) - shown_served
    stat_keys = {s.key for s in SERVED if s.source == STAT}
    covered = ({s.key for s in SERVED if s.source == RECORDED}
               | {router_prefix() + s.key for s in SERVED if s.source == ROUTER}
               | {name for key, name in {**engine_metrics._STAT_COUNTERS, **engine_metrics._STAT_GAUGES}.items() if key in stat_keys})
    shown = {spec.name for spec in cat.METRICS if used & set(spec.series())}
    assert shown | covered == set(cat.BY_NAME), set(cat.BY_NAME) - shown - covered


def router_prefix() -> str:
    from router import request_router

    return request_router.METRIC_PREFIX


def test_dashboard_layout_is_loadable():
    dashboard = json.loads(gd.DASHBOARD_PATH.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] and dashboard["title"]
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}"


def test_provisioning_files_match_the_dashboard():
    prov = yaml.safe_load((ROOT / "dashboards/provisioning/dashboards.yaml").read_text())
    assert prov["apiVersion"] == 1 and prov["providers"][0]["type"] == "file"
    assert prov["providers"][0]["options"]["path"].startswith("/")
    sources = yaml.safe_load((ROOT / "dashboards/provisioning/datasources.yaml").read_text())
    assert sources["datasources"][0]["type"] == "prometheus"
    prom = yaml.safe_load((ROOT / "dashboards/prometheus.yml").read_text())
    files = prom["scrape_configs"][0]["file_sd_configs"][0]["files"]
    assert files == ["/tmp/ray/prom_metrics_service_discovery.json"]


def test_docs_list_every_metric():
    docs = (ROOT / "docs/monitoring.md").read_text()
    assert gd.metrics_table() in docs, \
        "paste `python scripts/grafana_dashboard.py --metrics-table` into docs/monitoring.md"
    assert gd.served_table() in docs, \
        "paste `python scripts/grafana_dashboard.py --served-table` into docs/monitoring.md"


class GrafanaStub(BaseHTTPRequestHandler):
    received: list = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        GrafanaStub.received.append((self.path, self.headers.get("Authorization"), body))
        reply = json.dumps({"status": "success", "uid": body["dashboard"]["uid"], "url": "/d/x"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args) -> None:
        pass


def test_push_to_grafana_with_grafana_client(tmp_path):
    server = HTTPServer(("127.0.0.1", 0), GrafanaStub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert gd.main(["--output", str(tmp_path / "d.json"), "--grafana-url", url,
                        "--grafana-token", "secret"]) == 0
    finally:
        server.shutdown()
    path, auth, body = GrafanaStub.received[-1]
    assert path == "/api/dashboards/db" and auth == "Bearer secret"
    assert body["overwrite"] is True and body["dashboard"]["uid"] == gd.UID
    assert body["dashboard"]["id"] is None
    assert (tmp_path / "d.json").read_text() == gd.render(gd.build_dashboard())


# -- A real Prometheus scraping a running app ---------------------------------------------

CACHE_HIT_RATE = (f"sum({cat.BY_NAME[cat.ENGINE_CACHED_TOKENS].series()[0]}) / "
                  f"sum({cat.BY_NAME[cat.ENGINE_PROMPT_TOKENS].series()[0]})")


def start_ray_prometheus(tmp: Path, metrics_port: int) -> tuple[subprocess.Popen, str]:
    """Prometheus with the committed config's Ray job, its file_sd pointed at this test's Ray
    node (the shared /tmp/ray file may name another cluster running on this machine)."""
    targets = tmp / "targets.json"
    targets.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": [f"127.0.0.1:{metrics_port}"]}]))
    config = committed_config()
    job = scrape_job(config, "ray")
    job["file_sd_configs"][0]["files"] = [str(targets)]
    config["scrape_configs"] = [job]
    return start_prometheus(tmp, config)


@pytest.fixture(scope="module")
def monitored_app(tmp_path_factory):
    if PROMETHEUS is None:
        pytest.skip(SKIP_REASON)
    import ray
    from ray import serve

    from deployments.app import build_app

    # Workers push metrics to the node's agent every 10 s by default: 1 s keeps this short.
    saved = {k: os.environ.get(k) for k in ("RAY_metrics_report_interval_ms", "RAY_USAGE_STATS_ENABLED")}
    os.environ.update(RAY_metrics_report_interval_ms="1000", RAY_USAGE_STATS_ENABLED="0")
    metrics_port, http_port = free_port(), free_port()
    end_ray()  # its own metrics export port and report interval
    ray.init(num_cpus=8, include_dashboard=False, _metrics_export_port=metrics_port,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    prometheus = None
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        # One ingress keeps this test's load light (/v1/stats sums every ingress's router).
        args = serve_config_args(num_replicas=2, ingress_replicas=1, ray_actor_options={"num_cpus": 0.1})
        args["router"]["request_routing_stats_period_s"] = 0.5
        serve.run(build_app(args), name="radixserve", route_prefix="/")
        prometheus, prom_url = start_ray_prometheus(tmp_path_factory.mktemp("prometheus"), metrics_port)
        yield f"http://127.0.0.1:{http_port}", prom_url
    finally:
        if prometheus is not None:
            stop_prometheus(prometheus)
        serve.shutdown()
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def shared_prefix_traffic(base: str) -> None:
    """Requests sharing a long system prompt: all but the first find it cached."""
    system = "You are a helpful assistant for the radixserve monitoring test. " * 6
    with httpx.Client(base_url=base, timeout=60) as client:
        for i in range(6):
            r = client.post("/v1/completions", json={
                "prompt": f"{system} Question {i}: what is {i} plus {i}?",
                "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            if i == 0:  # the router knows the prefix's holder only once a digest arrives
                digest = wait_until(lambda: client.get("/v1/stats").json()["router"]
                                    .get("blocks_tracked", 0) > 0, timeout=30, interval=0.2)
                assert digest, client.get("/v1/stats").json()["router"]
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}).status_code == 400
        r = client.post("/v1/completions", json={"prompt": "Year:", "max_tokens": 4, "regex": "[0-9]{4}"})
        assert r.status_code == 200, r.text  # a grammar compile


@pytest.mark.slow
def test_prometheus_scrapes_ray_metrics_and_computes_cache_hit_rate(monitored_app):
    base, prom = monitored_app
    shared_prefix_traffic(base)
    stats = httpx.get(f"{base}/v1/stats", timeout=30).json()
    assert stats["num_replicas"] == 2 and len(stats["replicas"]) == 2
    for key in ("prompt_tokens", "cached_tokens", "total_slots", "steps"):
        assert stats[key] == sum(r[key] for r in stats["replicas"].values())
    assert stats["router"]["routed_with_match"] >= 1
    assert stats["cache_hit_rate"] > 0.3

    # Wait until Prometheus holds every admitted token, then compare its hit rate with ours.
    prompt_series = cat.BY_NAME[cat.ENGINE_PROMPT_TOKENS].series()[0]
    synced = wait_until(lambda: (r := promql(prom, f"sum({prompt_series})"))
                        and float(r[0]["value"][1]) == stats["prompt_tokens"], timeout=60, interval=1)
    assert synced, promql(prom, f"sum({prompt_series})")
    rate = float(promql(prom, CACHE_HIT_RATE)[0]["value"][1])
    assert rate == pytest.approx(stats["cache_hit_rate"], rel=1e-6)

    exported = promql(prom, 'group by (__name__) ({__name__=~"ray_radixserve_.*"})')
    names = {r["metric"]["__name__"] for r in exported}
    assert names <= cat.exported_series(), names - cat.exported_series()
    must_have = {cat.TIME_TO_FIRST_TOKEN, cat.INTER_TOKEN_LATENCY, cat.E2E_REQUEST_LATENCY, cat.BATCH_SIZE,
                 cat.NUM_RUNNING, cat.KV_CACHE_USAGE, cat.HTTP_REQUESTS, cat.ENGINE_REQUESTS,
                 cat.ROUTER_ROUTED_WITH_MATCH, cat.ACTUAL_CACHED_TOKENS, cat.QUEUE_TIME, cat.PREFILL_TIME,
                 cat.DECODE_TIME, cat.TIME_PER_OUTPUT_TOKEN, cat.REQUEST_PROMPT_LENGTH,
                 cat.REQUEST_GENERATION_LENGTH, cat.GRAMMAR_COMPILE_TIME}
    missing = {n for n in must_have if not set(cat.BY_NAME[n].series()) <= names}
    assert not missing
    http = cat.BY_NAME[cat.HTTP_REQUESTS].series()[0]
    by_status = promql(prom, f'sum by (status) ({http}{{endpoint="/v1/completions"}})')
    assert {r["metric"]["status"] for r in by_status} >= {"200", "400"}
    batch = cat.BY_NAME[cat.BATCH_SIZE].series()
    mean_batch = promql(prom, f"sum({batch[1]}) / sum({batch[2]})")  # sequential traffic: 1
    assert float(mean_batch[0]["value"][1]) == 1.0
    replicas = promql(prom, "count by (replica) (ray_radixserve_num_running_requests)")
    assert len(replicas) == 2
