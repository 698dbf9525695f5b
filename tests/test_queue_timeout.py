"""Queue deadlines in the engine (`max_queue_time_s`, a request's `queue_timeout_s`): a
request still waiting for its first admission past its deadline ends with QueueTimeoutError
(whose limit it was), nothing of it is computed, nothing leaks, and it is counted; on both
transports (the engine thread and the engine process) and under the overlap stepper.
Through HTTP: tests/test_priority_http.py."""
from __future__ import annotations

import asyncio
import time

import pytest

from engine import AsyncEngine, EngineConfig, ProcessAsyncEngine, QueueTimeoutError, SamplingParams
from engine.runtime.engine import Engine
from test_engine import assert_slots_accounted
from test_overlap import overlapped

GREEDY = dict(temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=480, **GREEDY)  # holds the one row for seconds


def config(path: str, **kw) -> EngineConfig:
    return EngineConfig(model=path, dtype="float32", max_total_tokens=1024,
                        max_running_requests=1, **kw)


@pytest.mark.parametrize("stepper", ["sync", "overlap"])
def test_a_request_past_its_deadline_ends_unrun_while_the_batch_is_busy(tiny_llama, stepper):
    eng = Engine(config(tiny_llama, max_queue_time_s=30.0))
    if stepper == "overlap":
        overlapped(eng)
    eng.add_request("busy", [5, 6, 7, 8], LONG)
    eng.step()
    late = eng.add_request("late", [9, 10, 11], SamplingParams(max_tokens=4, queue_timeout_s=0.2))
    started = time.monotonic()
    finished = []
    while not finished:
        finished = [u for u in eng.step() if u.finished]
        assert_slots_accounted(eng)
    assert time.monotonic() - started < 5.0
    assert [(u.req.request_id, u.new_tokens) for u in finished] == [("late", [])]
    assert late.finish_reason == "queue_timeout" and not late.admitted_once and late.kv is None
    error = eng.queue_timeout_error(late)
    assert error.by_request and "queue_timeout_s (0.2 s)" in str(error)
    stats = eng.stats()
    assert stats["queue_timeouts"] == 1 and stats["waiting"] == 0
    assert stats["prompt_tokens"] == 4  # the busy request's only: "late" computed nothing
    eng.abort("busy")
    assert_slots_accounted(eng, idle=True)


def test_the_deadline_is_checked_before_a_step_after_the_engine_sat_idle(tiny_llama):
    """Nothing stepped the engine while the request waited: the next step ends it before
    planning, and runs nothing."""
    eng = Engine(config(tiny_llama, max_queue_time_s=0.1))
    req = eng.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4, queue_timeout_s=5.0))
    time.sleep(0.2)
    updates = eng.step()
    assert [(u.req is req, u.finished) for u in updates] == [(True, True)]
    assert not eng.queue_timeout_error(req).by_request  # the server's limit was the tighter
    assert eng.stats()["steps"] == 0 and eng.stats()["prompt_tokens"] == 0


def test_admitted_and_retracted_requests_are_never_timed_out(tiny_llama):
    """A preempted request waits again, but it has streamed tokens: it resumes."""
    eng = Engine(config(tiny_llama))
    low = eng.add_request("low", [5, 6, 7], SamplingParams(max_tokens=40, queue_timeout_s=0.05, **GREEDY))
    eng.step()
    eng.add_request("high", [8, 9], SamplingParams(max_tokens=30, priority=-1, **GREEDY))
    eng.step()
    assert low.num_preemptions == 1
    time.sleep(0.1)
    while eng.has_work:
        eng.step()
    assert low.finish_reason == "length" and low.num_output == 40
    assert eng.stats()["queue_timeouts"] == 0


def test_settings_are_checked():
    for bad in (-1, 0, float("nan"), float("inf"), "1", True):
        with pytest.raises(ValueError, match="queue_timeout_s"):
            SamplingParams(queue_timeout_s=bad)
    SamplingParams(queue_timeout_s=2)  # an integer number of seconds is fine
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="max_queue_time_s"):
            EngineConfig(max_queue_time_s=bad)


@pytest.mark.parametrize("transport", ["thread", "process"])
@pytest.mark.parametrize("limit", ["request", "server"])
def test_transports_end_the_stream_with_the_error(tiny_llama, transport, limit):
    kind = AsyncEngine if transport == "thread" else ProcessAsyncEngine
    server_limit = 0.3 if limit == "server" else None
    eng = kind(config(tiny_llama, max_queue_time_s=server_limit))

    async def main():
        busy = eng.generate([5, 6, 7, 8], LONG, "busy")
        await anext(busy)  # it holds the batch's one row now
        params = SamplingParams(max_tokens=4, **({"queue_timeout_s": 0.3} if limit == "request" else {}))
        started = time.monotonic()
        with pytest.raises(QueueTimeoutError) as caught:
            async for _ in eng.generate([9, 10], params, "late"):
                pass
        waited = time.monotonic() - started
        await busy.aclose()  # aborts it
        return caught.value, waited, await eng.stats()

    try:
        error, waited, stats = asyncio.run(main())
    finally:
        eng.shutdown()
    assert error.by_request == (limit == "request")
    assert 0.25 < waited < 10.0
    assert stats["queue_timeouts"] == 1 and stats["prompt_tokens"] == 4
    assert stats["running"] == stats["waiting"] == 0
    assert stats["free_slots"] + stats["evictable_slots"] == stats["total_slots"]
