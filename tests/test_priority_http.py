"""Priorities and queue deadlines through the Serve app: real Ray, real HTTP, the official
openai client, SGLang's /generate and the front-end language; the engine on its thread and
in its own process (`engine_process: true`). The batches are small (2 and 1 requests), so
long requests fill them while others queue behind."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

import frontend as sgl
from engine import LLM, SamplingParams
from engine import ensure_demo_model
from serve_helpers import BASE, run_app, serve_config_args, start_ray, stop_ray, wait_until

pytestmark = pytest.mark.slow
MODEL = "radixserve-demo"
ENGINE = {"max_total_tokens": 4096, "max_queued_requests": 16}
SERVER_LIMIT_S = 0.4  # the engine process app's max_queue_time_s
APPS = {"thread": BASE, "process": f"{BASE}/engine-process"}
ROWS = {"thread": 2, "process": 1}  # max_running_requests
BUSY = {"prompt": "The old lighthouse keeper", "max_tokens": 500, "temperature": 0,
        "ignore_eos": True}  # seconds of decoding on a test box


@pytest.fixture(scope="module")
def server():
    start_ray()
    run_app(serve_config_args(ingress_replicas=1,
                              engine={**ENGINE, "max_running_requests": ROWS["thread"]}))
    run_app(serve_config_args(engine_process=True, ingress_replicas=1, engine={
        **ENGINE, "max_running_requests": ROWS["process"], "max_queue_time_s": SERVER_LIMIT_S}),
            name="engine-process", route_prefix="/engine-process")
    yield
    stop_ray()


class Streamed:
    """A streamed completion read on a thread of its own; `stop()` leaves it (an abort)."""

    def __init__(self, url: str, body: dict) -> None:
        self.text: list[str] = []
        self.started = threading.Event()
        self.ended_at: float | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._thread.start()
        assert self.started.wait(60), "the stream never started"

    def _run(self, url: str, body: dict) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "model": MODEL,
                                                                "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if self._stop:
                    break
                if line.startswith("data: {"):
                    self.text.append(json.loads(line[6:])["choices"][0]["text"])
                    self.started.set()
        self.ended_at = time.monotonic()

    def stop(self) -> None:
        self._stop = True
        self.join()

    def join(self) -> str:
        self._thread.join(120)
        return "".join(self.text)


def fill_the_batch(app: str) -> list[Streamed]:
    return [Streamed(APPS[app], BUSY) for _ in range(ROWS[app])]


def still_running(busy: list[Streamed]) -> bool:
    return all(b.ended_at is None for b in busy)


def stop(busy: list[Streamed]) -> None:
    for b in busy:
        b.stop()


def engine_stats(url: str) -> dict:
    return httpx.get(f"{url}/v1/stats", timeout=30).json()


def assert_idle_and_nothing_leaked(url: str) -> dict:
    stats = wait_until(lambda: (s := engine_stats(url))["running"] == s["waiting"] == 0 and s)
    assert stats, engine_stats(url)
    assert stats["free_slots"] + stats["evictable_slots"] == stats["total_slots"]
    return stats


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def offline_text(prompt: str, max_tokens: int) -> str:
    llm = LLM(model=ensure_demo_model(), dtype="float32", max_total_tokens=2048)
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                 ignore_eos=True))[0].text


# -- deadlines ----------------------------------------------------------------------------


@pytest.mark.parametrize("app", ["thread", "process"])
def test_a_request_past_its_own_queue_timeout_gets_408_quickly(server, app):
    url = APPS[app]
    before = engine_stats(url)
    busy = fill_the_batch(app)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as caught:
        client(url).completions.create(model=MODEL, prompt="A late request", max_tokens=4,
                                       extra_body={"queue_timeout_s": 0.2})
    assert time.monotonic() - started < 10
    assert still_running(busy)  # it failed while the batch was full, not after
    error = caught.value
    assert error.status_code == 408 and error.code == "queue_timeout"
    assert "queue_timeout_s (0.2 s)" in error.message
    stop(busy)
    stats = assert_idle_and_nothing_leaked(url)
    assert stats["queue_timeouts"] == before["queue_timeouts"] + 1
    # the late request's prompt was never admitted: only the busy one's counted
    busy_prompt = len(httpx.post(f"{url}/tokenize", json={"prompt": BUSY["prompt"]}).json()["tokens"])
    assert stats["prompt_tokens"] == before["prompt_tokens"] + ROWS[app] * busy_prompt


def test_the_servers_limit_gets_503_with_retry_after(server):
    url = APPS["process"]
    busy = fill_the_batch("process")
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
    assert still_running(busy)
    stop(busy)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "queue_timeout"
    assert f"server's limit ({SERVER_LIMIT_S:g} s)" in r.json()["error"]["message"]
    assert_idle_and_nothing_leaked(url)


def test_a_stream_that_times_out_before_its_first_token_gets_the_status(server):
    """A streamed chat completion still queued: the status is 408, no stream is started."""
    url = APPS["thread"]
    busy = fill_the_batch("thread")
    with pytest.raises(openai.APIStatusError) as caught:
        for _ in client(url).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                stream=True, extra_body={"queue_timeout_s": 0.2}):
            pass
    stop(busy)
    assert caught.value.status_code == 408
    assert_idle_and_nothing_leaked(url)


def test_a_choice_timing_out_mid_stream_ends_it_with_an_error_event(server):
    """n=2 with one row free: choice 0 streams while choice 1 waits past its deadline;
    the stream (status 200 already) ends with an error event and choice 0 is aborted."""
    url = APPS["thread"]
    busy = Streamed(url, BUSY)
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
            **BUSY, "model": MODEL, "n": 2, "stream": True, "queue_timeout_s": 0.3}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert r.status_code == 200
    assert any("choices" in e for e in events)
    assert events[-1]["error"]["code"] == "queue_timeout"
    assert still_running([busy])
    busy.stop()
    assert_idle_and_nothing_leaked(url)


@pytest.mark.parametrize("stream", [False, True])
def test_generate_honours_queue_timeout(server, stream):
    url = APPS["thread"]
    busy = fill_the_batch("thread")
    r = httpx.post(f"{url}/generate", timeout=60, json={
        "text": "A late request", "sampling_params": {"max_new_tokens": 4},
        "queue_timeout_s": 0.2, "stream": stream})
    stop(busy)
    assert r.status_code == 408 and r.json()["error"]["code"] == "queue_timeout"
    assert_idle_and_nothing_leaked(url)


def test_the_frontend_language_passes_both_fields(server):
    @sgl.function
    def late(s):
        s += "A late request" + sgl.gen("x", max_tokens=4, queue_timeout_s=0.2)

    url = APPS["thread"]
    backend = sgl.RuntimeEndpoint(url)
    busy = fill_the_batch("thread")
    state = late.run(backend=backend)
    stop(busy)
    with pytest.raises(sgl.ServerError) as caught:
        state["x"]
    assert caught.value.status == 408
    state = late.run(backend=backend, priority="high")  # a run default reaches the server too
    with pytest.raises(sgl.ServerError, match="priority") as caught:
        state["x"]
    assert caught.value.status == 400
    assert_idle_and_nothing_leaked(url)


# -- priorities ---------------------------------------------------------------------------


@pytest.mark.parametrize("app", ["thread", "process"])
def test_a_high_priority_request_preempts_and_the_preempted_one_is_unchanged(server, app):
    url = APPS[app]
    before = engine_stats(url)
    busy = fill_the_batch(app)
    high = client(url).completions.create(model=MODEL, prompt="An urgent question", max_tokens=8,
                                          temperature=0, extra_body={"priority": -5})
    assert still_running(busy)  # it finished first, on a row a busy request held
    assert high.usage.completion_tokens == 8
    expected = offline_text(BUSY["prompt"], BUSY["max_tokens"])
    assert [b.join() for b in busy] == [expected] * len(busy)
    stats = assert_idle_and_nothing_leaked(url)
    assert stats["priority_preemptions"] == before["priority_preemptions"] + 1


def test_higher_priority_is_admitted_before_earlier_lower_priority_requests(server):
    """Through the ingress and the router: two requests of priority 0 queue behind the
    busy ones, then one of priority -1 (over /generate) comes; it runs first, preempting."""
    url = APPS["thread"]
    busy = fill_the_batch("thread")
    done: dict[str, float] = {}

    def send(name: str, body: dict, path: str = "/v1/completions") -> None:
        r = httpx.post(f"{url}{path}", json=body, timeout=120)
        assert r.status_code == 200, r.text
        done[name] = time.monotonic()

    lows = [threading.Thread(target=send, args=(f"low{i}", {
        "model": MODEL, "prompt": f"Low {i}", "max_tokens": 8, "priority": 0}))
        for i in range(2)]
    for t in lows:
        t.start()
    assert wait_until(lambda: engine_stats(url)["waiting"] == 2)
    send("high", {"text": "High", "sampling_params": {"max_new_tokens": 8}, "priority": -1},
         "/generate")
    for t in lows:
        t.join(120)
    for b in busy:
        b.join()
    assert done["high"] < done["low0"] and done["high"] < done["low1"]
    assert done["high"] < min(b.ended_at for b in busy)
    assert_idle_and_nothing_leaked(url)


# -- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("priority", "1"), ("priority", 1.5), ("priority", True),
    ("queue_timeout_s", -1), ("queue_timeout_s", 0), ("queue_timeout_s", "soon"),
])
@pytest.mark.parametrize("endpoint", ["completions", "chat", "generate"])
def test_nonsense_values_are_a_400(server, endpoint, field, value):
    body = {
        "completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
        "chat": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        "generate": {"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
    }[endpoint]
    path = {"completions": "/v1/completions", "chat": "/v1/chat/completions",
            "generate": "/generate"}[endpoint]
    r = httpx.post(f"{BASE}{path}", json={**body, field: value}, timeout=30)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"] or r.json()["error"]["param"] == field
