"""AsyncEngine, what only the in-thread transport has: its engine is built on the thread
that steps it, and a failed step ends its requests while the engine lives on. The
EngineClient contract it shares with ProcessAsyncEngine (outputs, aborts, bad requests,
capacity, the wire form, start-up errors): tests/test_engine_client.py."""
from __future__ import annotations

import asyncio
import threading

import pytest

from engine import AsyncEngine, EngineConfig, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def run(coro):
    return asyncio.run(coro)


async def collect(engine, prompt, params, rid):
    deltas = [d async for d in engine.generate(prompt, params, request_id=rid)]
    return deltas


def assert_no_leak(stats):
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["free_slots"] + stats["evictable_slots"] == stats["total_slots"]


def test_a_failed_step_ends_its_requests_and_the_engine_lives_on(tiny_llama):
    from engine import EngineStepError

    eng = AsyncEngine(EngineConfig(model=tiny_llama, dtype="float32", max_total_tokens=512))
    runner = eng.engine.runner
    forward = runner.forward
    def flaky(plan):
        # Fail the first step that decodes both requests, however their arrivals fell
        # across steps: a fixed step number could be one holding only the first request.
        if plan.is_decode and len(plan.chunks) == 2:
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


def test_a_step_failing_before_admission_ends_the_waiting_requests(tiny_llama):
    """A failure that recurs on every step before any request runs (here: every step
    raises) ends the waiting requests with EngineStepError instead of spinning forever."""
    from engine import EngineStepError

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
