"""Start-up and readiness (deployments/readiness.py, docs/deploy.md "Start-up and readiness").

While no engine replica can serve, /health and /v1/models answer 503 with the OpenAI error
`engine_starting` within milliseconds and agree, a completion gets the same 503 with
Retry-After at once (nothing reaches an engine), and Serve does not call the app RUNNING;
once the engine is up, both answer 200, the app is RUNNING and completions run. The KubeRay
manifests' readiness check on /health (cluster_configs/) is run against the live app too.

The slow start is real, not a stand-in: the engine replica needs a resource ("engine_node")
that no node of the cluster has until the test adds a node with it, as when the GPU node for
a replica is still joining (KubeRay scaling from zero); then Serve places the replica and its
constructor builds the engine. The first tests check the readiness rules and the middleware
on a real FastAPI app, without Ray.
"""
from __future__ import annotations

import asyncio
import re
import statistics
import subprocess
import threading
import time

import httpx
import openai
import pytest
import yaml
from fastapi import FastAPI

from deployments import readiness as readiness_module
from deployments.errors import install_error_handlers
from deployments.ingress_parts import PartsLoader, PartsSource
from deployments.readiness import (PARTS_FAILED_CODE, STARTING_CODE, EngineReadiness,
                                   install_readiness, needs_engine)
from serve_helpers import ROOT, call_deployment, serve_config_args, start_local_cluster, wait_until

APP = "radixserve"
MODEL = "radixserve-demo"
ENGINE_RESOURCE = "engine_node"
PROBE_ROUNDS = 20


# -- the rules, without Ray ---------------------------------------------------------------


def test_which_requests_need_an_engine():
    for method, path in [("GET", "/health"), ("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL}"),
                         ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("POST", "/generate"), ("GET", "/health_generate"), ("POST", "/flush_cache")]:
        assert needs_engine(method, path), (method, path)
    for method, path in [("POST", "/tokenize"), ("GET", "/v1/stats"), ("GET", "/get_model_info"),
                         ("GET", "/v1/completions")]:
        assert not needs_engine(method, path), (method, path)


def test_ready_follows_the_routers_replicas_else_the_first_answer():
    state = EngineReadiness()
    assert not state.ready()  # nothing known yet
    state.answered = True
    assert state.ready()  # router unreadable: an engine answered
    state.replicas = lambda: []
    assert not state.ready()  # the router says no replica runs: that wins
    state.replicas = lambda: ["r1"]
    assert state.ready()


def test_watch_retries_until_an_engine_answers(monkeypatch):
    monkeypatch.setattr(readiness_module, "WATCH_RETRY_S", 0.01)
    calls = []

    async def ping():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("replica died")

    state = EngineReadiness()
    asyncio.run(state.watch(ping))
    assert state.answered and len(calls) == 3


def test_middleware_refuses_engine_requests_until_ready():
    api = FastAPI()
    install_error_handlers(api)
    state = install_readiness(api, PartsLoader())
    bodies_read = []

    @api.get("/health")
    async def health():
        return {"status": "ok"}

    @api.post("/v1/completions")
    async def completions(body: dict):
        bodies_read.append(body)
        return {"ok": True}

    @api.post("/tokenize")
    async def tokenize():
        return {"tokens": []}

    async def scenario():
        transport = httpx.ASGITransport(app=api)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            starting = [await client.get("/health"),
                        await client.post("/v1/completions", content=b"{not json")]
            open_route = await client.post("/tokenize")
            state.replicas = lambda: ["r1"]
            ready = [await client.get("/health"), await client.post("/v1/completions", json={"a": 1})]
            return starting, open_route, ready

    starting, open_route, ready = asyncio.run(scenario())
    for r in starting:  # refused before the body is read (the bad JSON would be a 400)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == STARTING_CODE and "starting" in r.json()["error"]["message"]
    assert open_route.status_code == 200
    assert [r.status_code for r in ready] == [200, 200] and bodies_read == [{"a": 1}]
    assert state.refused == 2


def test_while_the_ingress_parts_load_only_metrics_answers():
    """The tokenizer and model config load after the constructor: until then every request
    but a scrape gets the starting 503; once an engine is ready (Serve calls the app
    running) a request waits for them instead; a failed load says why."""
    api = FastAPI()
    install_error_handlers(api)
    parts = PartsLoader()
    state = install_readiness(api, parts)
    paths = ("/metrics", "/tokenize", "/v1/models")
    for path in paths:
        api.get(path)(lambda: {"ok": True})

    async def get_all(arrive=None):
        transport = httpx.ASGITransport(app=api)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            if arrive is not None:
                asyncio.get_running_loop().call_later(0.3, arrive)
            return {p: await client.get(p) for p in paths}

    parts.loaded = False
    loading = asyncio.run(get_all())
    assert loading["/metrics"].status_code == 200
    for path in paths[1:]:
        r = loading[path]
        assert r.status_code == 503 and r.headers["retry-after"] == "1", path
        assert r.json()["error"]["code"] == STARTING_CODE and "tokenizer" in r.json()["error"]["message"]

    state.replicas = lambda: ["r1"]  # an engine replica runs: requests wait for the parts

    def arrive():
        parts.loaded = True

    start = time.perf_counter()
    waited = asyncio.run(get_all(arrive))
    assert all(r.status_code == 200 for r in waited.values())
    assert time.perf_counter() - start >= 0.3

    parts.loaded, parts.error = False, "OSError: tokenizer.json is corrupt"
    failed = asyncio.run(get_all())["/tokenize"]
    assert failed.status_code == 503 and failed.json()["error"]["code"] == PARTS_FAILED_CODE
    assert "corrupt" in failed.json()["error"]["message"] and "retry-after" not in failed.headers


def test_parts_load_on_a_thread_and_a_missing_path_fails_at_once(tmp_path):
    from deployments.engine_replica import resolve_model

    model = resolve_model(None)  # the demo model
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        PartsSource(model, str(tmp_path / "no-such-tokenizer")).check()
    loader, got, threads, release = PartsLoader(), [], [], threading.Event()

    def on_loaded(parts):  # holds the loader's thread until released: `loaded` stays False
        threads.append(threading.get_ident())
        assert release.wait(60)
        got.append(parts)

    loader.start(PartsSource(model, model, max_model_len=64), on_loaded)
    assert not loader.loaded
    assert wait_until(lambda: threads, timeout=120, interval=0.05) and not loader.loaded
    release.set()
    assert wait_until(lambda: loader.loaded, timeout=60, interval=0.05)
    assert threads == [threads[0]] and threads[0] != threading.get_ident()
    parts = got[0]
    assert parts.max_context == 64 and parts.vocab_size > 0
    assert parts.tokenizer.decode(parts.tokenizer.encode("hello world")).strip() == "hello world"
    bad = PartsLoader()
    bad.start(PartsSource(model, str(tmp_path)), got.append)  # there, but no tokenizer in it
    assert wait_until(lambda: bad.error is not None, timeout=60, interval=0.05)
    assert not bad.loaded and len(got) == 1


# -- a slow engine start through Serve ----------------------------------------------------


def manifest_health_check(port: int) -> str:
    """The app part of the worker pods' readiness probe in cluster_configs/rayservice-gpu.yaml,
    pointed at `port` (tests/test_cluster_configs.py checks every manifest carries it)."""
    doc = yaml.safe_load((ROOT / "cluster_configs" / "rayservice-gpu.yaml").read_text())
    worker = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    command = worker["readinessProbe"]["exec"]["command"][-1]
    check = next(part.strip() for part in command.split("&&") if "/health" in part.split()[-1])
    return re.sub(r"localhost:\d+", f"127.0.0.1:{port}", check)


def probe(client: httpx.Client, path: str) -> tuple[int, float, dict]:
    start = time.perf_counter()
    r = client.get(path)
    return r.status_code, time.perf_counter() - start, r.json()


def app_status() -> str:
    from ray import serve

    app = serve.status().applications.get(APP)
    return app.status if app is not None else "MISSING"


@pytest.fixture
def starting_app(request):
    """The app deployed with its engine replica unplaceable; yields (cluster, base URL)."""
    from ray import serve

    from deployments.app import build_app

    cluster, port = start_local_cluster(request, {"num_cpus": 4})
    args = serve_config_args(
        ray_actor_options={"num_cpus": 0.2, "resources": {ENGINE_RESOURCE: 1}},
        engine={"max_running_requests": 8, "max_total_tokens": 2048, "max_queued_requests": 16})
    serve.run_many([serve.RunTarget(build_app(args), name=APP, route_prefix="/")],
                   wait_for_applications_running=False)
    base = f"http://127.0.0.1:{port}"

    def ingress_answers() -> bool:
        try:
            return httpx.get(f"{base}/health", timeout=5).status_code in (200, 503)
        except httpx.HTTPError:
            return False

    assert wait_until(ingress_answers, timeout=300, interval=0.5), "the ingress never answered"
    return cluster, base


def test_probes_and_completions_during_a_slow_engine_start(starting_app):
    cluster, base = starting_app
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    with httpx.Client(base_url=base, timeout=10) as http:
        # Starting: every probe is a fast 503 engine_starting, and both endpoints agree.
        latencies: dict[str, list[float]] = {}
        for _ in range(PROBE_ROUNDS):
            for path in ("/health", "/v1/models", f"/v1/models/{MODEL}"):
                status, seconds, body = probe(http, path)
                assert status == 503 and body["error"]["code"] == STARTING_CODE, (path, status, body)
                latencies.setdefault(path, []).append(seconds)
            time.sleep(0.05)
        for path, values in latencies.items():  # p50 on a loaded 2-core box
            assert statistics.median(values) < 0.1, (path, sorted(values))
        assert app_status() != "RUNNING"

        # A completion during start-up: 503 with Retry-After at once, nothing held.
        start = time.perf_counter()
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
        assert time.perf_counter() - start < 5
        assert refused.value.status_code == 503 and refused.value.code == STARTING_CODE
        assert refused.value.response.headers["retry-after"] == "1"
        with pytest.raises(openai.APIStatusError) as streamed:
            list(client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True))
        assert streamed.value.status_code == 503
        # The manifests' readiness check fails on the starting app.
        check = manifest_health_check(int(base.rsplit(":", 1)[1]))
        assert subprocess.run(["bash", "-c", check]).returncode != 0

        # The engine's node joins: Serve places the replica, its constructor builds the engine.
        cluster.add_node(num_cpus=2, resources={ENGINE_RESOURCE: 1})
        assert wait_until(lambda: probe(http, "/health")[0] == 200, timeout=300, interval=0.2)
        status, _, models = probe(http, "/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == [MODEL]
        r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4
        assert wait_until(lambda: app_status() == "RUNNING", timeout=30), app_status()
        assert subprocess.run(["bash", "-c", check]).returncode == 0
        # The refused requests never reached the engine, and nothing is left running.
        stats = http.get("/v1/stats").json()
        assert stats["finished_requests"] == 1 and stats["running"] == 0 and stats["waiting"] == 0

    # Only a launch loads the parts on a thread: a replica that Serve adds while another of
    # its deployment runs (scale-out, a replacement) loads them in its constructor. Seen
    # from a replica: none running while it constructs, itself once it runs.
    from ray import serve

    from deployments.ingress_parts import another_replica_serves

    @serve.deployment(ray_actor_options={"num_cpus": 0.1})
    class Sibling:
        def __init__(self) -> None:
            self.saw_another = another_replica_serves()

        def seen(self) -> tuple[bool, bool]:
            return self.saw_another, another_replica_serves()

    serve.run(Sibling.bind(), name="siblings", route_prefix=None)
    assert tuple(call_deployment("Sibling", "seen", app="siblings", timeout=60)) == (False, True)
    assert another_replica_serves() is False  # outside a replica
    serve.delete("siblings")
