"""The Serve app with `ingress: colocated` (deployments/colocated.py): one deployment that
serves HTTP and runs the engine. Greedy text equals the offline engine's through the official
openai client (whole, streamed, chat), bad input is a 400, the engine's bound a 503, a client
that leaves aborts its request, nothing leaks a KV slot, and /metrics reports both roles."""
from __future__ import annotations

import asyncio
import subprocess

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from engine.loading.demo_model import ensure_demo_model
from serve_helpers import BASE, run_app, serve_config_args, start_ray, stop_ray, wait_until

pytestmark = pytest.mark.slow
MODEL = "radixserve-demo"
URL = f"{BASE}/colocated"
ENGINE = {"max_total_tokens": 4096, "max_running_requests": 4, "max_queued_requests": 2}


@pytest.fixture(scope="module")
def server():
    start_ray()
    run_app(serve_config_args(ingress="colocated", engine=ENGINE), name="colocated",
            route_prefix="/colocated")
    yield
    stop_ray()


def read_stats() -> dict:
    return httpx.get(f"{URL}/v1/stats", timeout=30).json()


def assert_idle() -> None:
    s = wait_until(lambda: (s := read_stats())["running"] == 0 and s["waiting"] == 0 and s, timeout=30)
    assert s, read_stats()
    assert s["free_slots"] + s["evictable_slots"] == s["total_slots"]


def test_one_deployment_serves_http(server):
    from ray import serve

    deployments = serve.status().applications["colocated"].deployments
    assert set(deployments) == {"EngineIngress"}
    assert httpx.get(f"{URL}/health", timeout=30).json() == {"status": "ok"}
    assert httpx.get(f"{URL}/v1/models", timeout=30).json()["data"][0]["id"] == MODEL


def test_metrics_report_the_engine_and_the_ingress_of_each_replica(server):
    """/metrics of a colocated replica: its engine's series (under `engine=`) and its HTTP
    counters (under `ingress=`), the same Serve replica id, none missing."""
    from prometheus_client.parser import text_string_to_metric_families

    httpx.post(f"{URL}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60)
    text = httpx.get(f"{URL}/metrics", timeout=30).text
    families = {f.name: f.samples for f in text_string_to_metric_families(text)}
    engines = {s.labels["engine"] for s in families["vllm:num_requests_running"]}
    ingresses = {s.labels["ingress"] for s in families["radixserve:http_requests"]}
    assert len(engines) == 1 and engines == ingresses
    assert sum(s.value for s in families["vllm:e2e_request_latency_seconds"]
               if s.name.endswith("_count")) >= 1
    replicas = {s.labels["role"]: s.value for s in families["radixserve:scrape_replicas"]}
    missing = {s.labels["role"]: s.value for s in families["radixserve:scrape_replicas_missing"]}
    assert replicas == {"engine": 1, "ingress": 1} and set(missing.values()) == {0}


def test_greedy_text_matches_offline(server):
    client = openai.OpenAI(base_url=f"{URL}/v1", api_key="unused", max_retries=0, timeout=60)
    prompts = [f"The old lighthouse keeper {i}" for i in range(3)]
    greedy = dict(max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    offline = LLM(model=ensure_demo_model(), dtype="float32", max_total_tokens=4096).generate(
        prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))

    whole = [client.completions.create(model=MODEL, prompt=p, **greedy) for p in prompts]
    assert [r.choices[0].text for r in whole] == [o.text for o in offline]
    assert all(r.usage.completion_tokens == 12 for r in whole)

    async def stream(aclient, prompt):
        chunks = [c async for c in await aclient.completions.create(
            model=MODEL, prompt=prompt, stream=True, stream_options={"include_usage": True}, **greedy)]
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage

    async def streams():  # more than max_running_requests at once: some wait in the engine
        aclient = openai.AsyncOpenAI(base_url=f"{URL}/v1", api_key="unused", max_retries=0, timeout=60)
        return await asyncio.gather(*[stream(aclient, p) for p in prompts + prompts[:1]])

    for (text, usage), o in zip(asyncio.run(streams()), offline + offline[:1]):
        assert text == o.text and usage.completion_tokens == 12

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=8, temperature=0)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0,
        stream=True) if c.choices)
    assert chat.choices[0].message.content == streamed and chat.usage.completion_tokens == 8
    stats = read_stats()
    assert stats["num_replicas"] == 1 and stats["requests_on_own_stream"] >= 9
    assert stats["requests_on_channel"] == 0
    assert_idle()


def test_bad_input_and_the_engine_bound(server):
    client = openai.OpenAI(base_url=f"{URL}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert "max_tokens" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=1)

    async def many():  # 12 streams against room for 4 running + 2 queued
        async with httpx.AsyncClient(timeout=60) as c:
            async def one(i):
                body = {"model": MODEL, "prompt": f"Count {i}", "max_tokens": 48, "ignore_eos": True,
                        "stream": True}
                async with c.stream("POST", f"{URL}/v1/completions", json=body) as r:
                    body = await r.aread()
                    return r.status_code, body
            return await asyncio.gather(*[one(i) for i in range(12)])

    results = asyncio.run(many())
    codes = [code for code, _ in results]
    assert codes.count(200) >= 6 and 503 in codes, codes
    refused = next(body for code, body in results if code == 503)
    assert b'"error"' in refused
    assert_idle()
    ok = client.completions.create(model=MODEL, prompt="still here", max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_client_that_leaves_aborts(server):
    before = read_stats()["aborted_requests"]
    body = {"model": MODEL, "prompt": "Never ending", "max_tokens": 480, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{URL}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for _ in zip(range(3), r.iter_lines()):
            pass  # a few events, then leave
    after = wait_until(lambda: (s := read_stats())["aborted_requests"] > before and s, timeout=30)
    assert after, read_stats()
    assert_idle()


def test_engine_in_a_child_process(server):
    """`engine_process: true` with `ingress: colocated`: the step loop in a child process,
    HTTP in the replica. Its own app beside the module's; greedy text as offline."""
    from ray import serve

    run_app(serve_config_args(ingress="colocated", engine_process=True, engine=ENGINE),
            name="colocated-process", route_prefix="/colocated-process")
    try:
        client = openai.OpenAI(base_url=f"{BASE}/colocated-process/v1", api_key="unused",
                               max_retries=0, timeout=60)
        offline = LLM(model=ensure_demo_model(), dtype="float32", max_total_tokens=4096).generate(
            ["A quiet harbour"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
        r = client.completions.create(model=MODEL, prompt="A quiet harbour", max_tokens=10,
                                      temperature=0, extra_body={"ignore_eos": True})
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt="A quiet harbour", max_tokens=10, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if c.choices)
        assert r.choices[0].text == streamed == offline[0].text
        procs = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert "multiprocessing.spawn" in procs  # the replica's engine process
    finally:
        serve.delete("colocated-process")
