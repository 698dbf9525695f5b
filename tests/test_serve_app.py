"""The Ray Serve app end to end: real Ray, real HTTP, the official openai client."""
from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
import yaml

from engine import LLM, SamplingParams
from engine.loading.demo_model import ensure_demo_model
from serve_helpers import (
    BASE, ROOT, leave_a_non_streamed_request, serve_config_args, shared_app, stats, stop_ray,
    wait_until,
)

MODEL = "radixserve-demo"


@pytest.fixture(scope="module")
def server():
    shared_app()
    yield
    stop_ray()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(model=ensure_demo_model(), dtype="float32", max_total_tokens=4096)


def test_models_and_health(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    assert httpx.get(f"{BASE}/health").status_code == 200


def test_completion_greedy_equals_offline(client, offline):
    prompt = "The old lighthouse keeper"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True})
    ref = offline.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + 16


def test_token_id_prompts_and_batches(client, offline):
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300]]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    refs = offline.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [o.text for o in refs]
    assert r.usage.prompt_tokens == 8 and r.usage.completion_tokens == 12


def test_chat_uses_the_chat_template(client, offline):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    ids = offline.tokenizer.apply_chat_template(messages)
    ref = offline.generate([ids], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids)


def test_streaming_concatenates_to_the_full_text(client):
    kw = dict(model=MODEL, prompt="A long time ago", max_tokens=24, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streaming(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=20,
              temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full


def test_n_choices_and_seeds(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, n=2, seed=42)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    texts = lambda r: [c.text for c in sorted(r.choices, key=lambda c: c.index)]  # noqa: E731
    assert len(a.choices) == 2 and texts(a) == texts(b)
    assert texts(a)[0] != texts(a)[1]
    c = client.completions.create(**{**kw, "seed": 43})
    assert texts(c) != texts(a)


def test_stop_strings(client):
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=30, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    stop = full[4:7]
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]
    streamed = list(client.completions.create(stop=[stop], stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.text
    kept = client.completions.create(stop=[stop], **{**kw, "extra_body": {
        "ignore_eos": True, "include_stop_str_in_output": True}}).choices[0]
    assert kept.finish_reason == "stop" and kept.text == full[:full.index(stop) + len(stop)]


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 4 and all(len(t) <= 3 for t in lp.top_logprobs)
    assert all(x <= 0 for x in lp.token_logprobs)
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob, abs=1e-5)


def test_echo_scores_the_prompt_like_offline(client, offline):
    prompt = [5, 17, 33, 60, 2, 9, 41]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                  echo=True, logprobs=0)
    lp = r.choices[0].logprobs
    ref = offline.generate([prompt], SamplingParams(max_tokens=1, temperature=0,
                                                    prompt_logprobs_start=0, logprobs=True))[0]
    assert len(lp.tokens) == len(prompt) + 1 and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:len(prompt)] == pytest.approx(ref.prompt_logprobs[1:], abs=1e-4)
    assert r.choices[0].text.startswith(offline.tokenizer.decode(prompt))


def test_logit_bias_and_min_tokens_match_offline(client, offline):
    kw = dict(model=MODEL, prompt="The quick brown fox", temperature=0)
    biased = client.completions.create(max_tokens=4, extra_body={"ignore_eos": True,
                                                                 "logit_bias": {"100": 100}}, **kw)
    ref = offline.generate(["The quick brown fox"], SamplingParams(
        max_tokens=4, temperature=0, ignore_eos=True, logit_bias={100: 100.0}))[0]
    assert ref.token_ids == [100] * 4 and biased.choices[0].text == ref.text
    # Stop at the second greedy token, unless min_tokens bars it until 5 tokens are out.
    plain = offline.generate(["The quick brown fox"], SamplingParams(max_tokens=8, temperature=0,
                                                                     ignore_eos=True))[0]
    stop = {"stop_token_ids": [plain.token_ids[1]], "ignore_eos": True}
    early = client.completions.create(max_tokens=8, extra_body=stop, **kw)
    assert early.usage.completion_tokens == 2 and early.choices[0].finish_reason == "stop"
    held = client.completions.create(max_tokens=8, extra_body={**stop, "min_tokens": 5}, **kw)
    assert held.usage.completion_tokens >= 5


def test_echo_text_offsets_point_into_the_text(client):
    """The prompt's tokens include <s>, which the echoed text does not: it takes no room."""
    r = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=6,
                                  temperature=0, echo=True, logprobs=1)
    choice = r.choices[0]
    lp, text = choice.logprobs, choice.text
    assert lp.tokens[0] == "<s>" and lp.text_offset[:2] == [0, 0]
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(text)
    found = [text.startswith(t, o) for t, o in zip(lp.tokens[1:], lp.text_offset[1:]) if t.strip()]
    assert all(found), list(zip(lp.tokens, lp.text_offset))
    # Prompt tokens have their alternatives too (only the first, unscored, has none).
    assert lp.top_logprobs[0] is None and all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert all(max(top.values()) >= score - 1e-5
               for top, score in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))


def test_cached_tokens_in_usage(client):
    prompt = list(range(10, 110))
    kw = dict(model=MODEL, max_tokens=2, temperature=0)
    client.completions.create(prompt=prompt + [1], **kw)
    r = client.completions.create(prompt=prompt + [2], **kw)
    assert r.usage.prompt_tokens_details.cached_tokens >= 100


def test_client_disconnect_aborts_and_frees_slots(server):
    before = stats()["aborted_requests"]
    body = {"model": MODEL, "prompt": "Never ending", "max_tokens": 480, "stream": True,
            "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", f"{BASE}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
    # The stream is closed: the engine must abort the request and take back its KV.
    after = wait_until(lambda: (s := stats())["aborted_requests"] > before and s["running"] == 0 and s,
                       timeout=30)
    assert after, "request was not aborted after the client left"
    assert after["free_slots"] + after["evictable_slots"] == after["total_slots"]


def test_client_leaving_a_non_streamed_request_aborts_it(server):
    """Serve cancels the ingress call when the client goes; the engine must abort too."""
    # 16 choices x 480 tokens: ~3.4 s on the 2-core box, so the client surely leaves mid-way
    leave_a_non_streamed_request(BASE, MODEL, n=16, max_tokens=480)


def test_random_traffic_with_clients_leaving_leaks_nothing(server):
    """40 concurrent requests (completions and chat, streamed or not, n up to 3, some under
    a JSON schema), half of them dropped by their client at random moments: afterwards no
    request runs or waits, every KV slot is free or cached, and the server still answers."""
    import asyncio
    import random

    r = random.Random(7)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    async def one(c: httpx.AsyncClient):
        body = {"model": MODEL, "max_tokens": r.randint(1, 200), "n": r.choice([1, 1, 2, 3]),
                "temperature": r.choice([0, 1.0]), "stream": r.random() < 0.5}
        if r.random() < 0.5:
            url = "/v1/completions"
            body["prompt"] = [r.randint(3, 700) for _ in range(r.randint(1, 120))]
        else:
            url = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": "hi " * r.randint(1, 30)}]
        if r.random() < 0.3:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
        leave_after = r.choice([None, 0.05, 0.2, 0.5])

        async def go():
            if body["stream"]:
                async with c.stream("POST", BASE + url, json=body) as resp:
                    async for _ in resp.aiter_lines():
                        pass
                    return resp.status_code
            return (await c.post(BASE + url, json=body)).status_code

        try:
            return await asyncio.wait_for(go(), leave_after) if leave_after else await go()
        except asyncio.TimeoutError:
            return "left"

    async def traffic():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=100)) as c:
            return await asyncio.gather(*[one(c) for _ in range(40)])

    outcomes = asyncio.run(traffic())
    assert set(outcomes) <= {200, 503, "left"}, outcomes  # 503: the engine queue was full
    assert outcomes.count("left") >= 5
    after = wait_until(lambda: (s := stats())["running"] == 0 and s["waiting"] == 0 and s, timeout=60)
    assert after, "requests still running after every client finished or left"
    assert after["free_slots"] + after["evictable_slots"] == after["total_slots"]
    r2 = httpx.post(f"{BASE}/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "still here?", "max_tokens": 4, "ignore_eos": True})
    assert r2.status_code == 200 and r2.json()["usage"]["completion_tokens"] == 4


def test_concurrent_requests_are_batched(client):
    results = {}

    def one(i):
        results[i] = client.completions.create(model=MODEL, prompt=f"Request number {i}", max_tokens=20,
                                               temperature=0, extra_body={"ignore_eos": True})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    steps_before = stats()["steps"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.usage.completion_tokens == 20 for r in results.values())
    # 16 requests x 20 tokens one after another would take >= 320 steps.
    assert stats()["steps"] - steps_before < 200


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", b"[1, 2, 3]", 400),
    ("/v1/completions", b"\xff\xfe", 400),
    ("/v1/completions", {"model": MODEL}, 400),  # no prompt
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**7}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 5000, "max_tokens": 8}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": [10**6]}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": [-5, 3]}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": -7}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 1000}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 99}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": [""]}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": -1}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 9}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": "loud"}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "prompt_logprobs_start": -2}, 400),
    ("/v1/completions", {"model": "no-such-model", "prompt": "x"}, 404),
    # Not honoured: a 400, never a silent 200
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"5": 500}}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"five": 1}}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"1000000": 1}}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 3}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "suffix": "end"}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "include_stop_str_in_output": "yes"}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [10**6]}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "echo": "loud"}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 3}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 0}, 400),
    ("/v1/chat/completions", {"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404),
    ("/v1/nowhere", {}, 404),
]


@pytest.mark.parametrize("path, body, status", BAD_REQUESTS)
def test_bad_requests_get_openai_errors(server, path, body, status):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{BASE}{path}", content=content, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    assert set(err) >= {"message", "type", "param", "code"}


def test_server_still_answers_after_bad_input(client, server):
    for path, body, _ in BAD_REQUESTS:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        httpx.post(f"{BASE}{path}", content=content, timeout=30)
    r = client.completions.create(model=MODEL, prompt="still alive", max_tokens=3)
    assert r.usage.completion_tokens >= 1
    s = stats()
    assert s["running"] == 0 and s["free_slots"] + s["evictable_slots"] == s["total_slots"]


def test_queue_bound_gives_503(server):
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app(serve_config_args(
        ingress_replicas=1,
        engine={"max_running_requests": 1, "max_queued_requests": 1, "max_total_tokens": 2048})),
        name="tiny-queue", route_prefix="/tiny")
    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 200, "ignore_eos": True}
        with httpx.Client(timeout=60) as c:
            results = []
            threads = [threading.Thread(target=lambda: results.append(
                c.post(f"{BASE}/tiny/v1/completions", json=body))) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        codes = sorted(r.status_code for r in results)
        assert 200 in codes and 503 in codes, codes
        busy = next(r for r in results if r.status_code == 503)
        assert busy.headers.get("retry-after") and busy.json()["error"]["type"]
    finally:
        serve.delete("tiny-queue")


def test_serve_config_validates_with_rays_schema():
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(config)
    assert schema.applications[0].import_path == "deployments.app:build_app"


def test_bad_app_args_fail_clearly():
    from deployments.app import build_app

    with pytest.raises(ValueError, match="max_running_requests"):
        build_app({"engine": {"max_running_requests": 0}})
    with pytest.raises(ValueError, match="unknown engine setting"):
        build_app({"engine": {"no_such_knob": 1}})
    # a YAML string where a switch belongs would be truthy: refused, naming the field
    with pytest.raises(ValueError, match="enable_cuda_graph must be bool, got 'false'"):
        build_app({"engine": {"enable_cuda_graph": "false"}})
    with pytest.raises(ValueError, match="num_replicas"):
        build_app({"num_replicas": 0})
    for nonsense in (0, -1, "soon"):
        with pytest.raises(ValueError, match="graceful_shutdown_wait_loop_s"):
            build_app({"graceful_shutdown_wait_loop_s": nonsense})
    # the kernel settings, `engine: {kernels: {...}}`, checked the same way
    with pytest.raises(ValueError, match="unknown kernel setting"):
        build_app({"engine": {"kernels": {"pdl_off": True}}})
    with pytest.raises(ValueError, match="kernels.pdl must be bool, got 'false'"):
        build_app({"engine": {"kernels": {"pdl": "false"}}})
    with pytest.raises(ValueError, match="kernels.bf16_gemv_rows must be within 1-64"):
        build_app({"engine": {"kernels": {"bf16_gemv_rows": 128}}})


def test_engine_process_auto_follows_the_replica_device():
    """"auto" (the default): the step loop in a child process for a GPU replica at tp_size 1;
    on CPU replicas and at tensor parallelism in the replica's own process."""
    from deployments.config import AppArgs

    assert AppArgs().engine_process == "auto" and not AppArgs().use_engine_process
    gpu = {"num_cpus": 4, "num_gpus": 1}
    assert AppArgs(ray_actor_options=gpu).use_engine_process
    assert not AppArgs(ray_actor_options=gpu, engine={"tp_size": 2}).use_engine_process
    assert not AppArgs(ray_actor_options=gpu, engine_process=False).use_engine_process
    assert AppArgs(engine_process=True).use_engine_process
    with pytest.raises(ValueError, match="engine_process: true does not support"):
        AppArgs(engine_process=True, engine={"tp_size": 2})


def test_a_replica_that_dies_mid_request_ends_its_streams_and_comes_back(server):
    """Last in this module: it kills the module's engine replica. A stream in flight ends
    with an error event and [DONE], a waiting non-streamed request gets a 500 JSON error,
    and Serve's new replica then serves requests."""
    import ray

    body = {"model": MODEL, "prompt": "hi", "max_tokens": 480, "ignore_eos": True, "n": 4}
    results: dict = {}

    def streamed():
        with httpx.stream("POST", f"{BASE}/v1/completions", json={**body, "stream": True},
                          timeout=60) as r:
            results["stream"] = (r.status_code, [line for line in r.iter_lines() if line])

    def plain():
        results["plain"] = httpx.post(f"{BASE}/v1/completions", json=body, timeout=60)

    threads = [threading.Thread(target=streamed), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    assert wait_until(lambda: stats()["running"] >= 8, timeout=30), "requests never started"
    replica = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                   if "EngineReplica" in a["name"])
    ray.kill(ray.get_actor(replica["name"], namespace=replica["namespace"]), no_restart=True)
    for t in threads:
        t.join(timeout=60)
    status, lines = results["stream"]
    assert status == 200 and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][len("data: "):])["error"]["type"] == "server_error"
    plain_reply = results["plain"]
    assert plain_reply.status_code == 500 and plain_reply.json()["error"]["message"]

    def served():
        try:
            r = httpx.post(f"{BASE}/v1/completions", timeout=10, json={
                "model": MODEL, "prompt": "hi", "max_tokens": 4, "ignore_eos": True})
        except httpx.HTTPError:
            return False
        return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4

    assert wait_until(served, timeout=120, interval=0.5), "no new replica served requests"


def test_online_benchmark_smoke(server, tmp_path):
    """scripts/bench_online.py (O1) on the demo model, through this module's server and into
    the offline engine, with the same arrivals: both print their table and the report its
    HTTP/offline ratios. Smoke only: no timing is asserted."""
    import subprocess
    import sys

    from pathlib import Path

    vocab = json.loads((Path(ensure_demo_model()) / "config.json").read_text())["vocab_size"]
    common = ["--rates", "4", "--mixes", "fixed,longtail", "--duration", "1.5",
              "--length-scale", "0.05"]

    def bench(*args: str) -> str:
        done = subprocess.run([sys.executable, str(ROOT / "scripts/bench_online.py"), *args],
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    offline = bench("offline", "--model", "demo", *common, "--json", str(tmp_path / "offline.json"))
    http = bench("http", "--base-url", BASE, "--vocab", str(vocab), *common,
                 "--json", str(tmp_path / "http.json"))
    for out in (offline, http):
        assert "ttft_p50" in out and "goodput" in out
    rows = json.loads((tmp_path / "http.json").read_text())["rows"]
    assert [r["mix"] for r in rows] == ["fixed", "longtail"]
    assert all(r["failed"] == 0 and r["requests"] > 0 and r["steps"] > 0 for r in rows)
    report = bench("report", str(tmp_path / "offline.json"), str(tmp_path / "http.json"))
    assert report.count("http/offl") == 2
