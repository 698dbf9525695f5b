"""The Serve path under load, end to end: many concurrent streams over the delta channels,
admission control at the engine's bound, request body limits, and a model directory whose
tokenizer lives elsewhere. Real Ray, real HTTP."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time

import httpx
import pytest

from deployments.admission import REPORT_FRESH_S
from deployments.errors import OVERLOADED_MESSAGE
from engine.loading.demo_model import ensure_demo_model
from serve_helpers import (BASE, SHARED_APP_ENGINE, run_app, serve_config_args, start_ray,
                           stop_ray, wait_until)

pytestmark = pytest.mark.slow
SMALL = f"{BASE}/small"  # running 4 + queued 8 per replica, 1 MB bodies, tokenizer elsewhere
BODY_LIMIT = 1_000_000


def _model_without_tokenizer() -> str:
    """The demo model's config and weights, without any tokenizer file."""
    src = ensure_demo_model()
    dst = tempfile.mkdtemp(prefix="radixserve-no-tokenizer-")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(os.path.join(src, name), dst)
    return dst


@pytest.fixture(scope="module")
def server():
    # Its own engine, not the shared app: the 300-stream and bound tests must not depend on
    # what earlier files left running in a shared engine.
    start_ray()
    run_app(serve_config_args(ingress_replicas=2, engine=SHARED_APP_ENGINE))
    model = _model_without_tokenizer()
    run_app(serve_config_args(model=model, served_model_name="radixserve-demo",
                              ingress_replicas=1, max_request_body_bytes=BODY_LIMIT,
                              engine={"tokenizer": ensure_demo_model(), "max_running_requests": 4,
                                      "max_queued_requests": 8, "max_total_tokens": 4096}),
            name="small", route_prefix="/small")
    yield
    stop_ray()
    shutil.rmtree(model, ignore_errors=True)


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> tuple[str, dict, int]:
    """(text, usage, number of content events) of one streamed completion."""
    text, usage, events = [], None, 0
    async with client.stream("POST", url, json={**body, "stream": True,
                                                "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                text.append(choice["text"])
                events += 1
    return "".join(text), usage, events


def _no_kv_leak(base: str) -> None:
    stats = _stats(base)
    assert stats["running"] == 0 and stats["waiting"] == 0, stats
    assert stats["free_slots"] + stats["evictable_slots"] == stats["total_slots"], stats


def _stats(base: str) -> dict:
    return httpx.get(f"{base}/v1/stats", timeout=30).json()  # summed over replicas


def test_each_ingress_opens_its_channel_before_its_first_request(server):
    # No request has reached the app yet: a burst arriving now must find every channel open,
    # or its requests would each stream on their own call while they run.
    assert wait_until(lambda: _stats(BASE)["open_channels"] == 2, timeout=60), _stats(BASE)
    before = _stats(BASE)
    assert before["requests_on_channel"] + before["requests_on_own_stream"] == 0, before
    for _ in range(3):
        for _ in range(2):  # both ingress replicas, even where a balancer takes turns
            httpx.post(f"{BASE}/v1/completions", json={"prompt": "warm", "max_tokens": 2}, timeout=60)
    after = _stats(BASE)
    assert after["requests_on_channel"] == 6 and after["requests_on_own_stream"] == 0, after


def test_300_concurrent_streams_equal_non_streamed(server):
    prompts = [f"Story {i}: the traveller reached a quiet town where" for i in range(30)]
    bodies = []
    for i, prompt in enumerate(prompts):
        body = {"model": "radixserve-demo", "prompt": prompt, "max_tokens": 8 + i % 17,
                "temperature": 0}
        if i % 3 == 0:
            body["stop"] = ["e", " th"]  # common in the demo model's text: stops mid-stream
        bodies.append(body)
    assert wait_until(lambda: _stats(BASE)["open_channels"] == 2, timeout=60), _stats(BASE)
    before = _stats(BASE)

    async def run():
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
        async with httpx.AsyncClient(base_url=BASE, timeout=300, limits=limits) as client:
            streams = [_stream(client, "/v1/completions", bodies[k % 30]) for k in range(300)]
            plain = [client.post("/v1/completions", json=b) for b in bodies]
            return await asyncio.gather(*streams), await asyncio.gather(*plain)

    streamed, plain = asyncio.run(run())
    for k, (text, usage, _) in enumerate(streamed):
        ref = plain[k % 30].json()
        assert text == ref["choices"][0]["text"], (k, text, ref)
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached: cache state
        assert [usage[c] for c in counts] == [ref["usage"][c] for c in counts], (k, usage, ref)
    assert any(p.json()["choices"][0]["finish_reason"] == "stop" for p in plain)
    after = _stats(BASE)
    on_channel = after["requests_on_channel"] - before["requests_on_channel"]
    assert on_channel == 330 and after["open_channels"] == 2, (before, after)
    _no_kv_leak(BASE)


def test_burst_over_the_bound_is_refused_at_once_and_loses_nothing(server):
    body = {"model": "radixserve-demo", "prompt": "A long road", "max_tokens": 48,
            "ignore_eos": True, "temperature": 0}

    async def run():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=100)) as client:
            return await asyncio.gather(*[client.post(f"{SMALL}/v1/completions", json=body)
                                          for _ in range(60)])

    responses = asyncio.run(run())
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 503]
    assert len(ok) + len(refused) == 60, [r.status_code for r in responses]
    assert len(ok) >= 12 and refused, (len(ok), len(refused))  # capacity: 4 running + 8 queued
    for r in refused:
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["message"] == OVERLOADED_MESSAGE
    texts = {r.json()["choices"][0]["text"] for r in ok}
    assert len(texts) == 1  # every accepted request ran to its end, greedy: the same text
    assert all(r.json()["usage"]["completion_tokens"] == 48 for r in ok)
    _no_kv_leak(SMALL)


def test_a_request_larger_than_the_engines_bound_runs_through_it_in_turn(server):
    """10 prompts x 3 choices = 30 engine calls against room for 12 (4 running + 8 queued):
    the ingress keeps at most a batch of them (4) in flight, so the request is answered
    whole instead of refused for the bound; streamed, every choice's text is the same."""
    prompts = [f"Tale {i}: at dawn the" for i in range(10)]
    body = {"model": "radixserve-demo", "prompt": prompts, "n": 3, "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{SMALL}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == list(range(30))
    singles = [httpx.post(f"{SMALL}/v1/completions", timeout=60, json={
        **body, "prompt": p, "n": 1}).json()["choices"][0]["text"] for p in prompts]
    for c in choices:  # choice index = prompt * n + j
        assert c["text"] == singles[c["index"] // 3] and c["finish_reason"] == "length", c
    assert r.json()["usage"]["completion_tokens"] == 30 * 6

    streamed = {}
    with httpx.stream("POST", f"{SMALL}/v1/completions", json={**body, "stream": True},
                      timeout=120) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for c in chunk["choices"]:
                    streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
    assert streamed == {c["index"]: c["text"] for c in choices}
    _no_kv_leak(SMALL)

    # A client that leaves after the first event: the calls in flight are aborted, and the
    # rest never reach the engine.
    before = _engine_calls(SMALL)
    with httpx.stream("POST", f"{SMALL}/v1/completions", timeout=120,
                      json={**body, "max_tokens": 400, "stream": True}) as s:
        next(line for line in s.iter_lines() if line.startswith("data: "))
    assert wait_until(lambda: _stats(SMALL)["running"] == 0, timeout=30)
    assert _engine_calls(SMALL) - before < 30
    _no_kv_leak(SMALL)


def _engine_calls(base: str) -> int:
    stats = _stats(base)
    return stats["requests_on_channel"] + stats["requests_on_own_stream"]


def test_full_engine_refused_at_the_ingress_and_room_admitted(server):
    """With the engine full, the ingress answers the engine's 503 itself (the engine's load
    reports on the delta channel say it is full: deployments/admission.py), so the probes
    never reach the engine; once the streams are gone, a request is admitted at once."""
    for _ in range(30):  # the ingress's delta channel to the engine replica is open
        httpx.post(f"{SMALL}/v1/completions", json={"prompt": "warm", "max_tokens": 2}, timeout=60)
        if _stats(SMALL)["open_channels"] == 1:
            break
    hold = {"model": "radixserve-demo", "prompt": "A long road", "max_tokens": 480,
            "ignore_eos": True, "temperature": 0, "stream": True}
    probe = {"model": "radixserve-demo", "prompt": "A long road", "max_tokens": 4}

    async def run():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=40)) as client:
            async def held():
                async with client.stream("POST", f"{SMALL}/v1/completions", json=hold) as r:
                    async for _ in r.aiter_bytes():
                        pass

            holders = [asyncio.create_task(held()) for _ in range(12)]  # 4 running + 8 queued
            for _ in range(600):
                stats = (await client.get(f"{SMALL}/v1/stats")).json()
                if stats["running"] + stats["waiting"] == 12:
                    break
                await asyncio.sleep(0.05)
            # The gate defers to the engine for REPORT_FRESH_S after any call of this ingress
            # ends (the warm-up's last one may have just ended; under HAProxy the holders are
            # in within that window).
            await asyncio.sleep(2 * REPORT_FRESH_S)
            before = _engine_calls(SMALL)
            probes = [await client.post(f"{SMALL}/v1/completions", json=probe) for _ in range(5)]
            reached = _engine_calls(SMALL) - before
            for task in holders:
                task.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
            return probes, reached

    probes, reached = asyncio.run(run())
    assert [r.status_code for r in probes] == [503] * 5, [r.text for r in probes]
    for r in probes:
        assert r.headers["retry-after"] == "1" and r.json()["error"]["message"] == OVERLOADED_MESSAGE
    assert reached < 5, reached  # without the ingress's gate every probe reaches the engine
    for _ in range(100):  # the cancelled streams are aborted in the engine
        stats = _stats(SMALL)
        if stats["running"] + stats["waiting"] == 0:
            break
        time.sleep(0.1)
    r = httpx.post(f"{SMALL}/v1/completions", json=probe, timeout=60)
    assert r.status_code == 200, r.text  # room again: the gate lets it through
    _no_kv_leak(SMALL)


def test_body_limit_and_undecodable_text(server):
    big = {"model": "radixserve-demo", "prompt": "x" * (BODY_LIMIT + 10), "max_tokens": 1}
    r = httpx.post(f"{SMALL}/v1/completions", json=big, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # a prompt under the body limit but far over the context: refused before tokenizing
    r = httpx.post(f"{SMALL}/v1/completions", timeout=60,
                   json={"model": "radixserve-demo", "prompt": "x" * (BODY_LIMIT - 100), "max_tokens": 1})
    assert r.status_code == 400 and "cannot fit" in r.json()["error"]["message"]
    lone = '"a\\ud800b"'
    for path, body in (("/v1/completions", f'{{"prompt": {lone}, "max_tokens": 2}}'),
                       ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": {lone}}}]}}'),
                       ("/tokenize", f'{{"prompt": {lone}}}')):
        r = httpx.post(f"{BASE}{path}", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, r.status_code, r.text)
        assert "surrogate" in r.json()["error"]["message"]
    assert httpx.post(f"{BASE}/v1/completions", json={"prompt": "still fine", "max_tokens": 2}).status_code == 200


def test_model_directory_with_tokenizer_elsewhere_serves(server):
    body = {"model": "radixserve-demo", "prompt": "The lighthouse", "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    small = httpx.post(f"{SMALL}/v1/completions", json=body, timeout=60).json()
    main = httpx.post(f"{BASE}/v1/completions", json=body, timeout=60).json()
    assert small["choices"][0]["text"] == main["choices"][0]["text"] != ""
    assert small["usage"] == {**main["usage"], "prompt_tokens_details": small["usage"]["prompt_tokens_details"]}
