"""The EngineClient contract (engine/runtime/engine_client.py), run against both transports:
AsyncEngine (the step loop on a thread) and ProcessAsyncEngine (in a child process).

Outputs equal the offline engine's, aborts and early exits free KV, bad requests fail on
the caller's side before anything is queued, capacity is counted on the caller's side,
the wire form agrees with the streamed one, step listeners see the radix cache's events,
and an EngineReplica over either serves the same. Their signatures against the Protocol:
tests/test_engine_interface.py. What only one transport has (the thread's build and
failed steps; the child's death, orphans): tests/test_async_engine.py and
tests/test_process_engine.py."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest

from engine import (
    LLM, AsyncEngine, EngineClient, EngineConfig, ProcessAsyncEngine, QueueFullError,
    SamplingParams, StepReport, WireDelta,
)
from serve_helpers import wait_until

GREEDY = dict(temperature=0.0, ignore_eos=True)
TRANSPORTS = ["thread", "process"]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["n"], "additionalProperties": False}


def config(model: str, **kw) -> EngineConfig:
    return EngineConfig(**{"model": model, "dtype": "float32", "max_total_tokens": 1024,
                           "chunked_prefill_size": 32, **kw})


def make_client(transport: str, model: str, **kw) -> EngineClient:
    kind = AsyncEngine if transport == "thread" else ProcessAsyncEngine
    return kind(config(model, **kw))


@pytest.fixture(scope="module", params=TRANSPORTS)
def client(request, tiny_llama) -> EngineClient:
    eng = make_client(request.param, tiny_llama, enable_cache_events=True)  # as the replica's
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def offline(tiny_llama) -> LLM:
    return LLM(model=tiny_llama, dtype="float32", max_total_tokens=1024)


def detokenizes(client: EngineClient) -> bool:
    """AsyncEngine streams text by default; the process transport streams token ids only."""
    return getattr(client, "detokenize", False)


def run(coro):
    return asyncio.run(coro)


async def collect(client, prompt, params, rid):
    return [d async for d in client.generate(prompt, params, request_id=rid)]


async def wired(client, prompt, params, rid) -> list[WireDelta]:
    got: list[WireDelta] = []
    await client.stream_to(prompt, params, rid, got.append, wire=True)
    return got


def assert_no_leak(stats):
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["free_slots"] + stats["evictable_slots"] == stats["total_slots"]


def test_is_an_engine_client(client):
    assert isinstance(client, EngineClient) and client.is_alive()
    assert client.capacity is None and client.in_flight == 0  # max_queued_requests = 0


# -- outputs -----------------------------------------------------------------------------------


def test_stream_equals_offline(client, offline):
    prompt = "The quick brown fox jumps"
    params = SamplingParams(max_tokens=20, **GREEDY)
    deltas = run(collect(client, prompt, params, "s1"))
    expected = offline.generate([prompt], params)[0]
    assert [t for d in deltas for t in d.token_ids] == expected.token_ids
    assert "".join(d.text for d in deltas) == (expected.text if detokenizes(client) else "")
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert deltas[-1].completion_tokens == 20
    assert not any(d.finished for d in deltas[:-1])
    # every delta carries the prompt's count (the wire form's middle deltas leave it out)
    assert {d.prompt_tokens for d in deltas} == {len(expected.prompt_token_ids)}


def test_streamed_text_with_a_stop_string_is_never_taken_back(client, offline):
    """With a stop string the engine decodes (whatever the transport) and stops where the
    offline engine does; a stream with text holds back what may still turn out to be the
    stop's start: its deltas add up to the offline text, cut right before the stop."""
    prompt = "The quick brown fox jumps"
    free = offline.generate([prompt], SamplingParams(max_tokens=20, **GREEDY))[0]
    # A stop string from the last character of one token's text into the next token's:
    # its first character is decoded a step before the stop is known.
    texts = [offline.tokenizer.decode(free.token_ids[:k]) for k in range(len(free.token_ids) + 1)]
    assert free.text == texts[-1]
    stop = next(s for a, b in zip(texts[1:], texts[2:]) if len(b) - len(a) >= 2
                for s in [b[len(a) - 1:len(a) + 1]]
                if s.isascii() and s.strip() and free.text.index(s) == len(a) - 1)
    params = SamplingParams(max_tokens=20, stop=[stop], **GREEDY)
    deltas = run(collect(client, prompt, params, "stop1"))
    assert [t for d in deltas for t in d.token_ids] == offline.generate([prompt], params)[0].token_ids
    if detokenizes(client):
        assert "".join(d.text for d in deltas) == free.text[:free.text.index(stop)]
    assert deltas[-1].finish_reason == "stop"


def mixed_batch() -> list[tuple[list[int], SamplingParams]]:
    """Concurrent streams: plain greedy, stop strings, max_tokens 1, a JSON schema."""
    prompts = [[5 + i, 40 + 3 * i, 7, 99 - i, 12 + i] for i in range(8)]
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (1, 5, 17, 30)]
    params += [SamplingParams(max_tokens=30, stop=["e", " t"], temperature=0.0),
               SamplingParams(max_tokens=25, stop=["a"], include_stop_str_in_output=True,
                              temperature=0.0),
               SamplingParams(max_tokens=40, json_schema=SCHEMA, temperature=0.0),
               SamplingParams(max_tokens=12, logprobs=True, top_logprobs=2, **GREEDY)]
    return list(zip(prompts, params))


def test_mixed_batch_equals_the_offline_engine(client, offline):
    """What a server makes of each request's wire deltas: tokens, finish, counts, logprobs
    (to 3 places: the batch a step runs in moves the last float bits)."""
    batch = mixed_batch()

    async def all_at_once():
        return await asyncio.gather(*[wired(client, p, sp, f"m{i}") for i, (p, sp) in enumerate(batch)])

    got = run(all_at_once())
    expected = [offline.generate([p], sp)[0] for p, sp in batch]
    for deltas, out in zip(got, expected):
        last = deltas[-1]
        assert [t for d in deltas for t in d.token_ids] == out.token_ids
        assert (last.finished, last.finish_reason, last.completion_tokens) == (
            True, out.finish_reason, len(out.token_ids))
        assert [round(x, 3) for d in deltas for x in d.extra("logprobs", [])] == [
            round(x, 3) for x in out.logprobs or []]
        assert deltas[0].extra("prompt_tokens") == len(out.prompt_token_ids)
    assert {d[-1].finish_reason for d in got} >= {"length", "stop"}
    assert not any(d.finished for deltas in got for d in deltas[:-1])  # finished only at the end
    assert_no_leak(run(client.stats()))


def test_wire_deltas_equal_stream_deltas(client):
    """The wire form (what the engine replica forwards on delta channels): the same tokens
    and ending as `generate`'s deltas; counts and logprobs in the first and last delta (and
    logprobs in every one that has them), no extras in between."""
    for params in (SamplingParams(max_tokens=12, **GREEDY),
                   SamplingParams(max_tokens=6, logprobs=True, **GREEDY)):
        plain = run(collect(client, [5, 6, 7, 8, 9], params, "w-plain"))
        wire = run(wired(client, [5, 6, 7, 8, 9], params, "w-wire"))
        assert all(type(d) is WireDelta and d.request_id == "w-wire" for d in wire)
        assert [x for d in wire for x in d.token_ids] == [x for d in plain for x in d.token_ids]
        assert wire[-1].finished and wire[-1].finish_reason == "length"
        assert not any(d.finished for d in wire[:-1])
        assert [d.completion_tokens for d in wire] == list(range(1, len(wire) + 1))
        for d in (wire[0], wire[-1]):
            assert d.extra("prompt_tokens") == 5 and "cached_tokens" in d.extras
        if params.logprobs:
            assert [x for d in wire for x in d.extras["logprobs"]] == [x for d in plain for x in d.logprobs]
        else:
            assert len(wire) > 2 and all(d.extras is None for d in wire[1:-1])
    assert_no_leak(run(client.stats()))


def test_many_concurrent_requests(client):
    async def main():
        r = random.Random(0)
        prompts = [[r.randint(3, 400) for _ in range(r.randint(5, 60))] for _ in range(24)]
        results = await asyncio.gather(*[
            collect(client, p, SamplingParams(max_tokens=r.randint(1, 30), **GREEDY), f"c{i}")
            for i, p in enumerate(prompts)])
        return results, await client.stats()

    results, stats = run(main())
    assert all(res[-1].finished for res in results)
    assert_no_leak(stats)


def test_a_slow_consumer_gets_merged_deltas(client, offline):
    """A consumer that falls behind receives the deltas queued meanwhile as one: fewer,
    larger deltas that add up to exactly the offline output, logprobs and all."""
    prompt = "Once upon a time"
    params = SamplingParams(max_tokens=24, logprobs=True, **GREEDY)

    async def slow():
        finished = (await client.stats())["finished_requests"]
        deltas = []
        async for d in client.generate(prompt, params, request_id="slow"):
            deltas.append(d)
            # Fall behind until the request has finished: each step's deltas reach this
            # loop before the answer to a later stats call, so all of them are queued.
            while (await client.stats())["finished_requests"] == finished:
                await asyncio.sleep(0.01)
        return deltas

    deltas = run(slow())
    expected = offline.generate([prompt], params)[0]
    # one token per step, 24 steps: whatever came after the first delta arrived as one
    assert len(deltas) <= 2, "queued deltas were not merged"
    assert [t for d in deltas for t in d.token_ids] == expected.token_ids
    assert "".join(d.text for d in deltas) == (expected.text if detokenizes(client) else "")
    logprobs = [x for d in deltas for x in (d.logprobs or [])]
    assert logprobs == pytest.approx(expected.logprobs, abs=1e-4)
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert not any(d.finished for d in deltas[:-1])
    assert deltas[-1].completion_tokens == 24
    assert_no_leak(run(client.stats()))


# -- aborts, bad requests, capacity ------------------------------------------------------------


def test_abort_mid_stream_frees_slots(client):
    async def main():
        gen = client.generate([5, 6, 7, 8], SamplingParams(max_tokens=400, **GREEDY), request_id="ab")
        got = []
        async for d in gen:
            got.append(d)
            if sum(len(x.token_ids) for x in got) >= 3:
                await client.abort("ab")
        return got, await client.stats()

    got, stats = run(main())
    assert got[-1].finished and got[-1].finish_reason == "abort"
    # The abort runs between two steps, after the earlier steps' deltas were handed over:
    # the stream carries every token generated before it, once, and nothing after it.
    assert sum(len(d.token_ids) for d in got) == got[-1].completion_tokens < 400
    assert_no_leak(stats)


def test_consumer_leaving_early_aborts(client):
    async def main():
        before = await client.stats()
        gen = client.generate([9, 10, 11], SamplingParams(max_tokens=400, **GREEDY), request_id="early")
        async for _ in gen:
            break
        await gen.aclose()  # queues the abort; engine commands run in order, so ...
        return before, await client.stats()  # ... these stats come after it

    before, stats = run(main())
    assert stats["aborted_requests"] == before["aborted_requests"] + 1
    assert_no_leak(stats)


def test_invalid_requests_fail_on_the_callers_side(client):
    cases = [([], SamplingParams(), "empty"),
             ([5], SamplingParams(max_tokens=100000), "context length"),
             ([10**6], SamplingParams(), "outside the vocabulary"),
             ([5], SamplingParams(json_schema={"type": "integer", "minimum": 5, "maximum": 2}),
              "minimum greater than maximum")]

    async def main():
        before = await client.stats()
        for prompt, params, message in cases:
            with pytest.raises(ValueError, match=message):
                await wired(client, prompt, params, "bad")
            with pytest.raises(ValueError, match=message):
                await collect(client, prompt, params, "bad")
        return before, await client.stats()

    before, after = run(main())
    assert after["prompt_tokens"] == before["prompt_tokens"]  # nothing reached the engine
    assert client.in_flight == 0
    assert_no_leak(after)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_capacity_is_counted_on_the_callers_side(tiny_llama, transport):
    """Capacity (running + queued) is counted by the client: the request over it is refused
    without a round trip. A burst as large as the capacity, arriving between two steps, is
    taken whole (the engine's waiting bound counts the batch's free places)."""
    eng = make_client(transport, tiny_llama, max_running_requests=2, max_queued_requests=1)
    try:
        async def main():
            params = SamplingParams(max_tokens=300, **GREEDY)
            runs = []
            for i in range(3):  # two running, then one queued
                started = asyncio.Event()
                runs.append(asyncio.ensure_future(eng.stream_to(
                    [5, 6, i + 7], params, f"q{i}", lambda d, e=started: e.set(), wire=True)))
                if i < 2:
                    await started.wait()
            await asyncio.sleep(0.05)
            assert not any(r.done() for r in runs)
            assert (eng.in_flight, eng.capacity) == (3, 3)
            with pytest.raises(QueueFullError, match="capacity"):
                eng.check_capacity()
            with pytest.raises(QueueFullError, match="capacity"):
                await eng.stream_to([5, 6], params, "q3", lambda d: None, wire=True)
            for r in runs:
                r.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
            short = SamplingParams(max_tokens=4, **GREEDY)
            burst = await asyncio.gather(*[eng.stream_to([5, 6, i], short, f"b{i}", lambda d: None,
                                                         wire=True) for i in range(3)],
                                         return_exceptions=True)
            return burst, await eng.stats()

        burst, stats = run(main())
        assert burst == [None, None, None], burst
        assert eng.in_flight == 0
        assert_no_leak(stats)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_failed_build_raises_from_the_constructor(tiny_llama, tmp_path, transport):
    """The build's exception, raised by the constructor (a bad model fails `serve run` with
    the real error, no hang); from the engine process with the child's traceback as a note."""
    start = time.monotonic()
    with pytest.raises(ValueError, match="model_type") as info:
        make_client(transport, str(tmp_path), tokenizer=tiny_llama)
    if transport == "process":
        assert "in the engine process" in info.value.__notes__[0]
    with pytest.raises(OSError):  # no model, no tokenizer
        make_client(transport, str(tmp_path / "no-such-model"))
    assert time.monotonic() - start < 60


# -- what a server reads -----------------------------------------------------------------------


def test_stats_flush_cache_and_step_listener(client):
    reports: list[StepReport] = []
    client.add_step_listener(reports.append)

    async def main():
        await client.stream_to(list(range(20, 60)), SamplingParams(max_tokens=4, **GREEDY), "st",
                               lambda d: None, wire=True)
        cached = (await client.stats())["cached_slots"]
        await client.flush_cache()
        return cached, await client.stats()

    cached, stats = run(main())
    assert cached > 0 and stats["cached_slots"] == 0
    assert_no_leak(stats)
    assert wait_until(lambda: any(r.stats for r in reports), timeout=5)
    assert any(r.cache_events for r in reports)  # the radix inserts, for the replica's digest
    assert max(r.stats["steps"] for r in reports if r.stats) <= stats["steps"]


def test_an_engine_replica_over_it(client, tiny_llama, offline, monkeypatch):
    """EngineReplica (outside Serve) over this client: its own-stream path yields
    WireDeltas that add up to the offline output, bad input is a 400 item, its step
    listener feeds the routing stats, and a dead engine fails its health check. (Last:
    it stops the module's client.)"""
    from deployments.engine_replica import EngineCall, EngineReplica

    in_child = isinstance(client, ProcessAsyncEngine)
    # A replica hands its process's garbage collection to a thread for good
    # (deployments/gc_thread.py); this process is the test session's.
    monkeypatch.setattr("deployments.engine_replica.collect_on_own_thread", lambda: None)

    class Replica(EngineReplica):
        def _start_engine(self, config: EngineConfig) -> EngineClient:
            return client

    replica = Replica(tiny_llama, {"dtype": "float32"}, engine_process=in_child)
    params = SamplingParams(max_tokens=6, **GREEDY)

    async def calls():
        before = await replica.stats()
        good = [x async for x in replica.generate(EngineCall("r1", [5, 6, 7], params))]
        bad = [x async for x in replica.generate(EngineCall("r2", [], params))]
        return before, good, bad, await replica.stats()

    before, good, bad, stats = run(calls())
    expected = offline.generate([[5, 6, 7]], params)[0]
    assert all(type(d) is WireDelta for d in good)
    assert [t for d in good for t in d.token_ids] == expected.token_ids
    assert (good[-1].finished, good[-1].finish_reason, good[-1].completion_tokens) == (True, "length", 6)
    assert {d.extra("prompt_tokens") for d in good} - {None} == {3}
    assert len(bad) == 1 and bad[0]["status"] == 400 and "empty" in bad[0]["error"]
    assert stats["finished_requests"] == before["finished_requests"] + 1
    assert stats["requests_on_own_stream"] == 2
    assert wait_until(lambda: replica.record_routing_stats()["cache_digest"], timeout=5)
    replica.check_health()
    if in_child:
        os.kill(client.pid, signal.SIGKILL)
    else:
        client.shutdown()
    assert wait_until(lambda: not client.is_alive(), timeout=10)
    with pytest.raises(RuntimeError, match="engine process" if in_child else "engine thread"):
        replica.check_health()
