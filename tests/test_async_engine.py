"""AsyncEngine: streaming, abort, early exit, concurrency, errors, no KV leaks. The abort
contract runs against ProcessAsyncEngine too (the engine in a child process; its own tests:
tests/test_process_engine.py)."""
from __future__ import annotations

import asyncio
import random
import threading

import pytest

from engine import LLM, AsyncEngine, EngineConfig, ProcessAsyncEngine, QueueFullError, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = AsyncEngine(EngineConfig(model=tiny_llama, dtype="float32", max_total_tokens=512,
                                   chunked_prefill_size=32))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module", params=["thread", "process"])
def either_engine(request, engine, tiny_llama):
    """The module's AsyncEngine, then a ProcessAsyncEngine of the same model."""
    if request.param == "thread":
        yield engine
        return
    eng = ProcessAsyncEngine(EngineConfig(model=tiny_llama, dtype="float32", max_total_tokens=512,
                                          chunked_prefill_size=32))
    yield eng
    eng.shutdown()


def run(coro):
    return asyncio.run(coro)


async def collect(engine, prompt, params, rid):
    deltas = [d async for d in engine.generate(prompt, params, request_id=rid)]
    return deltas


def assert_no_leak(stats):
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["free_slots"] + stats["evictable_slots"] == stats["total_slots"]


def test_stream_equals_offline(engine, tiny_llama):
    prompt = "The quick brown fox jumps"
    params = SamplingParams(max_tokens=20, **GREEDY)
    deltas = run(collect(engine, prompt, params, "s1"))
    offline = LLM(model=tiny_llama, dtype="float32", max_total_tokens=512).generate([prompt], params)[0]
    assert "".join(d.text for d in deltas) == offline.text
    assert [t for d in deltas for t in d.token_ids] == offline.token_ids
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert deltas[-1].completion_tokens == 20
    assert not any(d.finished for d in deltas[:-1])


def test_streamed_text_with_a_stop_string_is_never_taken_back(engine, tiny_llama):
    """With a stop string the stream holds back text that may still turn out to be its
    start: the deltas add up to the offline text, cut right before the stop."""
    prompt = "The quick brown fox jumps"
    llm = LLM(model=tiny_llama, dtype="float32", max_total_tokens=512)
    free = llm.generate([prompt], SamplingParams(max_tokens=20, **GREEDY))[0]
    # A stop string from the last character of one token's text into the next token's:
    # its first character is decoded a step before the stop is known.
    texts = [llm.tokenizer.decode(free.token_ids[:k]) for k in range(len(free.token_ids) + 1)]
    assert free.text == texts[-1]
    stop = next(s for a, b in zip(texts[1:], texts[2:]) if len(b) - len(a) >= 2
                for s in [b[len(a) - 1:len(a) + 1]]
                if s.isascii() and s.strip() and free.text.index(s) == len(a) - 1)
    params = SamplingParams(max_tokens=20, stop=[stop], **GREEDY)
    deltas = run(collect(engine, prompt, params, "stop1"))
    assert "".join(d.text for d in deltas) == free.text[:free.text.index(stop)]
    assert deltas[-1].finish_reason == "stop"


def test_many_concurrent_requests(engine):
    async def main():
        r = random.Random(0)
        prompts = [[r.randint(3, 400) for _ in range(r.randint(5, 60))] for _ in range(24)]
        results = await asyncio.gather(*[
            collect(engine, p, SamplingParams(max_tokens=r.randint(1, 30), **GREEDY), f"c{i}")
            for i, p in enumerate(prompts)])
        return results, await engine.stats()

    results, stats = run(main())
    assert all(res[-1].finished for res in results)
    assert_no_leak(stats)


def test_abort_mid_stream_frees_slots(either_engine):
    engine = either_engine

    async def main():
        gen = engine.generate([5, 6, 7, 8], SamplingParams(max_tokens=400, **GREEDY), request_id="ab")
        got = []
        async for d in gen:
            got.append(d)
            if sum(len(x.token_ids) for x in got) >= 3:
                await engine.abort("ab")
        return got, await engine.stats()

    got, stats = run(main())
    assert got[-1].finished and got[-1].finish_reason == "abort"
    # The abort runs between two steps, after the earlier steps' deltas were handed over:
    # the stream carries every token generated before it, once, and nothing after it.
    assert sum(len(d.token_ids) for d in got) == got[-1].completion_tokens < 400
    assert_no_leak(stats)


def test_consumer_leaving_early_aborts(either_engine):
    engine = either_engine

    async def main():
        before = await engine.stats()
        gen = engine.generate([9, 10, 11], SamplingParams(max_tokens=400, **GREEDY), request_id="early")
        async for _ in gen:
            break
        await gen.aclose()  # queues the abort; engine commands run in order, so ...
        return before, await engine.stats()  # ... these stats come after it

    before, stats = run(main())
    assert stats["aborted_requests"] == before["aborted_requests"] + 1
    assert_no_leak(stats)


def test_invalid_request_raises_before_queueing(engine):
    async def main():
        with pytest.raises(ValueError, match="empty"):
            await collect(engine, [], SamplingParams(), "bad1")
        with pytest.raises(ValueError, match="context length"):
            await collect(engine, [5], SamplingParams(max_tokens=100000), "bad2")
        return await engine.stats()

    assert_no_leak(run(main()))


def test_queue_bound(tiny_llama):
    eng = AsyncEngine(EngineConfig(model=tiny_llama, dtype="float32", max_total_tokens=256,
                                   max_running_requests=1, max_queued_requests=1))
    try:
        async def main():
            tasks = [asyncio.create_task(collect(eng, [5, 6], SamplingParams(max_tokens=200, **GREEDY),
                                                 f"q{i}")) for i in range(4)]
            results = await asyncio.gather(*tasks, return_exceptions=True)
            return results, await eng.stats()

        results, stats = run(main())
        assert any(isinstance(r, QueueFullError) for r in results)
        assert any(isinstance(r, list) for r in results)
        assert_no_leak(stats)
    finally:
        eng.shutdown()


def test_a_slow_consumer_gets_merged_deltas(engine, tiny_llama):
    """A consumer that falls behind receives the deltas queued meanwhile as one: fewer,
    larger deltas that add up to exactly the offline output, logprobs and all."""
    prompt = "Once upon a time"
    params = SamplingParams(max_tokens=24, logprobs=True, **GREEDY)

    def gone(eng) -> bool:
        return "slow" not in eng.requests  # the engine drops a request once it finished

    async def slow():
        deltas = []
        async for d in engine.generate(prompt, params, request_id="slow"):
            deltas.append(d)
            # Fall behind until the request has finished: each step's deltas reach this
            # loop before any later engine command's result, so all of them are queued.
            while not await engine.call(gone):
                await asyncio.sleep(0.01)
        return deltas

    deltas = run(slow())
    offline = LLM(model=tiny_llama, dtype="float32", max_total_tokens=512).generate(
        [prompt], SamplingParams(max_tokens=24, logprobs=True, **GREEDY))[0]
    # one token per step, 24 steps: whatever came after the first delta arrived as one
    assert len(deltas) <= 2, "queued deltas were not merged"
    assert [t for d in deltas for t in d.token_ids] == offline.token_ids
    assert "".join(d.text for d in deltas) == offline.text
    logprobs = [x for d in deltas for x in (d.logprobs or [])]
    assert logprobs == pytest.approx(offline.logprobs, abs=1e-4)
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert not any(d.finished for d in deltas[:-1])
    assert deltas[-1].completion_tokens == 24
    assert_no_leak(run(engine.stats()))


def test_a_failed_step_ends_its_requests_and_the_engine_lives_on(tiny_llama):
    from engine.runtime.async_engine import EngineStepError

    eng = AsyncEngine(EngineConfig(model=tiny_llama, dtype="float32", max_total_tokens=512))
    runner = eng.engine.runner
    forward = runner.forward
    calls = []

    def flaky(plan):
        calls.append(1)
        if len(calls) == 3:  # mid-way through both requests' decoding
            raise RuntimeError("simulated device fault")
        return forward(plan)

    runner.forward = flaky

    async def main():
        params = SamplingParams(max_tokens=20, **GREEDY)
        first = await asyncio.gather(*[collect(eng, p, params, f"f{i}")
                                       for i, p in enumerate(["one two", "three four"])],
                                     return_exceptions=True)
        again = await collect(eng, "one two", params, "after")
        return first, again, await eng.stats()

    try:
        first, again, stats = run(main())
    finally:
        eng.shutdown()
    assert all(isinstance(e, EngineStepError) and "simulated device fault" in str(e) for e in first)
    assert again[-1].finished and sum(len(d.token_ids) for d in again) == 20
    assert stats["aborted_requests"] == 2 and stats["finished_requests"] == 1
    assert_no_leak(stats)


def test_wire_deltas_equal_stream_deltas(engine):
    """The wire form (what the engine replica forwards on delta channels): the same tokens
    and ending as `generate`'s deltas; counts and logprobs in the first and last delta (and
    logprobs in every one that has them), bare tuples in between."""
    from engine import wire_dict

    async def wire(rid, params):
        got = []
        await engine.stream_to([5, 6, 7, 8, 9], params, rid, got.append, wire=True)
        return got

    for params in (SamplingParams(max_tokens=12, **GREEDY),
                   SamplingParams(max_tokens=6, logprobs=True, **GREEDY)):
        plain = run(collect(engine, [5, 6, 7, 8, 9], params, "w-plain"))
        tuples = run(wire("w-wire", params))
        assert all(t[0] == "w-wire" for t in tuples)
        dicts = [wire_dict(t) for t in tuples]
        assert [x for d in dicts for x in d["token_ids"]] == [x for d in plain for x in d.token_ids]
        assert dicts[-1]["finished"] and dicts[-1]["finish_reason"] == "length"
        assert not any(d["finished"] for d in dicts[:-1])
        assert [d["completion_tokens"] for d in dicts] == list(range(1, len(dicts) + 1))
        for d in (dicts[0], dicts[-1]):
            assert d["prompt_tokens"] == 5 and "cached_tokens" in d
        if params.logprobs:
            assert [x for d in dicts for x in d["logprobs"]] == [x for d in plain for x in d.logprobs]
        else:
            assert len(tuples) > 2 and all(t[5] is None for t in tuples[1:-1])
    assert_no_leak(run(engine.stats()))


def test_a_step_failing_before_admission_ends_the_waiting_requests(tiny_llama):
    """A failure that recurs on every step before any request runs (here: every step
    raises) ends the waiting requests with EngineStepError instead of spinning forever."""
    from engine.runtime.async_engine import EngineStepError

    eng = AsyncEngine(EngineConfig(model=tiny_llama, dtype="float32", max_total_tokens=256))

    def broken_step():
        raise RuntimeError("scheduler bug")

    eng.engine.step = broken_step
    try:
        async def main():
            with pytest.raises(EngineStepError, match="scheduler bug"):
                await asyncio.wait_for(collect(eng, [5, 6], SamplingParams(max_tokens=8, **GREEDY),
                                               "doomed"), 10)
            return await eng.stats()

        stats = run(main())
        assert stats["waiting"] == 0 and stats["running"] == 0
        assert eng.is_alive()
    finally:
        eng.shutdown()


def test_engine_is_built_on_the_thread_that_steps_it(tiny_llama):
    """A CPU model's OpenMP regions run fastest from the one thread that loaded it
    (engine/runtime/async_engine.py): AsyncEngine builds its engine
    on its step thread, and that thread runs every step."""
    from engine.runtime.engine import Engine

    config = EngineConfig(model=tiny_llama, dtype="float32", max_total_tokens=512)
    threads = {}

    def make_engine():
        threads["build"] = threading.get_ident()
        engine = Engine(config)
        step = engine.step

        def recorded_step():
            threads.setdefault("steps", set()).add(threading.get_ident())
            return step()

        engine.step = recorded_step
        return engine

    eng = AsyncEngine(config, make_engine=make_engine)
    try:
        out = run(collect(eng, [5, 6, 7], SamplingParams(max_tokens=3, **GREEDY), "t"))
        assert sum(len(d.token_ids) for d in out) == 3
        assert threads["build"] != threading.get_ident()
        assert threads["steps"] == {threads["build"]}
    finally:
        eng.shutdown()


def test_a_failed_build_raises_from_the_constructor(tmp_path):
    with pytest.raises(Exception, match="no-such-model|not found|does not exist|No such"):
        AsyncEngine(EngineConfig(model=str(tmp_path / "no-such-model")))
