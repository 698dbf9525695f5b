"""ProcessAsyncEngine: the engine's step loop in a child process (engine/runtime/process_engine.py).

Same outputs as AsyncEngine, aborts free KV (with AsyncEngine's own abort tests, which
run against both: tests/test_async_engine.py), errors keep their types (400/503 at the
server), a dead child ends its streams with an error (never a hang), and a dead parent
leaves no orphan child."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from engine import (
    AsyncEngine, EngineConfig, EngineProcessError, ProcessAsyncEngine, QueueFullError,
    SamplingParams, StepReport,
)
from serve_helpers import ROOT, wait_until

GREEDY = dict(temperature=0.0, ignore_eos=True)
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["n"], "additionalProperties": False}


def config(model: str, **kw) -> EngineConfig:
    return EngineConfig(**{"model": model, "dtype": "float32", "max_total_tokens": 1024,
                           "chunked_prefill_size": 32, **kw})


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = ProcessAsyncEngine(config(tiny_llama, enable_cache_events=True))  # as the replica's
    yield eng
    eng.shutdown()


def run(coro):
    return asyncio.run(coro)


def assert_no_leak(stats):
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["free_slots"] + stats["evictable_slots"] == stats["total_slots"]


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


async def run_batch(engine, batch) -> list[list[tuple]]:
    """Each request's wire deltas, all requests at once."""
    outs: list[list[tuple]] = [[] for _ in batch]
    await asyncio.gather(*[engine.stream_to(p, sp, f"m{i}", outs[i].append, wire=True)
                           for i, (p, sp) in enumerate(batch)])
    return outs


def summary(deltas: list[tuple]) -> tuple:
    """What a server makes of a request's deltas: tokens, finish, counts, logprobs (to 3
    places: the batch a step runs in moves the last float bits)."""
    last = deltas[-1]
    logprobs = [round(x, 3) for d in deltas for x in (d[5] or {}).get("logprobs", [])]
    return ([t for d in deltas for t in d[1]], last[2], last[3], last[4], logprobs,
            (deltas[0][5] or {}).get("prompt_tokens"))


def test_mixed_batch_equals_async_engine(engine, tiny_llama):
    batch = mixed_batch()
    reference = AsyncEngine(config(tiny_llama), detokenize=False)
    try:
        expected = run(run_batch(reference, batch))
    finally:
        reference.shutdown()
    got = run(run_batch(engine, batch))
    assert [summary(d) for d in got] == [summary(d) for d in expected]
    assert {d[-1][3] for d in got} >= {"length", "stop"}
    assert not any(d[2] for deltas in got for d in deltas[:-1])  # finished only at the end
    assert_no_leak(run(engine.stats()))


def test_generate_yields_stream_deltas(engine):
    async def main():
        params = SamplingParams(max_tokens=9, **GREEDY)
        streamed = [d async for d in engine.generate([3, 4, 5, 6], params, "g1")]
        wired: list[tuple] = []
        await engine.stream_to([3, 4, 5, 6], params, "g2", wired.append, wire=True)
        return streamed, wired

    streamed, wired = run(main())
    assert [t for d in streamed for t in d.token_ids] == [t for d in wired for t in d[1]]
    last = streamed[-1]
    assert last.finished and last.finish_reason == "length" and last.completion_tokens == 9
    # Every delta carries the prompt's count, as AsyncEngine's (the wire form's middle
    # deltas leave it out).
    assert all(d.prompt_tokens == 4 and d.text == "" for d in streamed)


def test_invalid_requests_fail_on_the_callers_side(engine):
    async def main():
        before = await engine.stats()
        cases = [([], SamplingParams(), "empty"),
                 ([5], SamplingParams(max_tokens=100000), "context length"),
                 ([10**6], SamplingParams(), "outside the vocabulary"),
                 ([5], SamplingParams(json_schema={"type": "integer", "minimum": 5, "maximum": 2}),
                  "minimum greater than maximum")]
        for prompt, params, message in cases:
            with pytest.raises(ValueError, match=message):
                await engine.stream_to(prompt, params, "bad", lambda d: None, wire=True)
        return before, await engine.stats()

    before, after = run(main())
    assert after["prompt_tokens"] == before["prompt_tokens"]  # nothing reached the engine


def test_queue_full_is_refused_at_once(tiny_llama):
    """Capacity (running + queued) is counted in the parent: the request over it is refused
    without a round trip. A burst as large as the capacity, arriving between two steps, is
    taken whole (the engine's waiting bound counts the batch's free places)."""
    eng = ProcessAsyncEngine(config(tiny_llama, max_running_requests=2, max_queued_requests=1))
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
            start = time.monotonic()
            with pytest.raises(QueueFullError, match="capacity"):
                await eng.stream_to([5, 6], params, "q3", lambda d: None, wire=True)
            refused_in = time.monotonic() - start
            for r in runs:
                r.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
            burst = await asyncio.gather(*[eng.stream_to([5, 6, i], params, f"b{i}", lambda d: None,
                                                         wire=True) for i in range(3)],
                                         return_exceptions=True)
            return refused_in, burst, await eng.stats()

        refused_in, burst, stats = run(main())
        assert refused_in < 0.1
        assert burst == [None, None, None], burst
        assert_no_leak(stats)
    finally:
        eng.shutdown()


def test_stats_flush_cache_and_step_listener(engine):
    reports: list[StepReport] = []
    engine.add_step_listener(reports.append)

    async def main():
        await engine.stream_to(list(range(20, 60)), SamplingParams(max_tokens=4, **GREEDY), "st",
                               lambda d: None, wire=True)
        cached = (await engine.stats())["cached_slots"]
        await engine.flush_cache()
        return cached, await engine.stats()

    cached, stats = run(main())
    assert cached > 0 and stats["cached_slots"] == 0
    assert_no_leak(stats)
    assert wait_until(lambda: any(r.stats for r in reports), timeout=5)
    assert any(r.cache_events for r in reports)  # the radix inserts, for the replica's digest
    assert max(r.stats["steps"] for r in reports if r.stats) <= stats["steps"]


def test_startup_error_is_raised_from_the_constructor(tiny_llama, tmp_path):
    """The child's start-up exception, re-raised by the constructor with the child's
    traceback as a note (a bad model fails `serve run` with the real error, no hang)."""
    start = time.monotonic()
    with pytest.raises(ValueError, match="model_type") as info:
        ProcessAsyncEngine(EngineConfig(model=str(tmp_path), tokenizer=tiny_llama))
    assert "in the engine process" in info.value.__notes__[0]
    with pytest.raises(OSError):  # no tokenizer there either: the parent's load says so
        ProcessAsyncEngine(EngineConfig(model=str(tmp_path / "no-such-model")))
    assert time.monotonic() - start < 60


def test_tp_above_1_is_refused():
    with pytest.raises(ValueError, match="tp_size"):
        ProcessAsyncEngine(EngineConfig(model="x", tp_size=2))


def test_child_death_ends_streams_with_an_error(tiny_llama):
    eng = ProcessAsyncEngine(config(tiny_llama))
    try:
        async def main():
            got = []
            run_ = asyncio.ensure_future(eng.stream_to(
                [5, 6, 7], SamplingParams(max_tokens=450, **GREEDY), "dies", got.append, wire=True))
            for _ in range(500):
                if got or run_.done():
                    break
                await asyncio.sleep(0.01)
            assert got and not run_.done()
            os.kill(eng.pid, signal.SIGKILL)
            with pytest.raises(EngineProcessError, match="died"):
                await asyncio.wait_for(run_, 10)
            with pytest.raises(EngineProcessError):
                await eng.stats()
            with pytest.raises(EngineProcessError):
                await eng.stream_to([5], SamplingParams(), "after", lambda d: None, wire=True)

        run(main())
        assert not eng.is_alive()
    finally:
        eng.shutdown()


def test_a_failed_step_ends_its_requests_with_an_error(tiny_llama):
    """The child's loop (run here on a thread, the engine in this process): a step that
    raises ends the requests in it with EngineStepError items, frees their KV, and the loop
    lives on."""
    import multiprocessing
    import threading

    from engine import Engine, EngineStepError
    from engine.runtime.engine_process_main import STOP, Add, EngineProcess

    engine = Engine(config(tiny_llama))
    real_step, calls = engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real_step()

    engine.step = step
    commands, command_end = multiprocessing.Pipe(duplex=False)
    out_end, out = multiprocessing.Pipe(duplex=False)
    loop = threading.Thread(target=EngineProcess(engine, commands, out, os.getppid()).loop)
    loop.start()
    try:
        command_end.send([Add("x", 7, [5, 6, 7], SamplingParams(max_tokens=50, **GREEDY))])
        messages = [out_end.recv()]
        while not messages[-1].errors:
            assert out_end.poll(10)
            messages.append(out_end.recv())
    finally:
        command_end.send([STOP])
        loop.join(10)
    (seq, error), = messages[-1].errors
    assert seq == 7 and isinstance(error, EngineStepError) and "boom" in str(error)
    deltas = [d for m in messages for _, d in m.deltas]
    assert len(deltas) == 1 and len(deltas[0][1]) == 1  # the first step's token, then the error
    assert_no_leak(engine.stats())


ORPHAN_SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from engine import EngineConfig, ProcessAsyncEngine
    if __name__ == "__main__":
        eng = ProcessAsyncEngine(EngineConfig(model={model!r}, dtype="float32", max_total_tokens=512))
        print(eng.pid, flush=True)
        time.sleep(600)
""")


def test_parent_killed_leaves_no_orphan(tiny_llama, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(ORPHAN_SCRIPT.format(root=str(ROOT), model=tiny_llama))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        child_pid = int(parent.stdout.readline())
        assert _alive(child_pid)
        parent.kill()  # SIGKILL: no cleanup runs in the parent
        parent.wait(10)
        assert wait_until(lambda: not _alive(child_pid), timeout=5), "the engine process outlived its parent"
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    """Running (a zombie, reaped by init soon, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_engine_replica_with_the_engine_process(tiny_llama):
    """EngineReplica(engine_process=True), outside Serve: the own-stream path yields the same
    dicts as with the in-process engine, bad input is a 400, the step listener feeds the
    routing stats, and a dead child fails the health check."""
    from deployments.engine_replica import EngineCall, EngineReplica

    kwargs = {"dtype": "float32", "max_total_tokens": 1024}
    sampling = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}

    async def calls(replica):
        good = [x async for x in replica.generate(EngineCall("r1", [5, 6, 7], sampling))]
        bad = [x async for x in replica.generate(EngineCall("r2", [], sampling))]
        return good, bad, await replica.stats()

    def outcome(items):  # how deltas merge depends on timing: compare what they add up to
        last = {k: v for k, v in items[-1].items() if k not in ("queue_time", "token_ids")}
        return [t for x in items for t in x["token_ids"]], last, {x["prompt_tokens"] for x in items}

    replicas = [EngineReplica(tiny_llama, kwargs, engine_process=flag) for flag in (False, True)]
    try:
        (ref, ref_bad, _), (got, bad, stats) = [run(calls(r)) for r in replicas]
        assert outcome(got) == outcome(ref) and bad == ref_bad
        assert bad[0]["status"] == 400 and stats["finished_requests"] == 1
        replica = replicas[1]
        assert wait_until(lambda: replica.record_routing_stats()["cache_digest"] and
                          replica._stats.get("steps") == stats["steps"], timeout=5)
        replica.check_health()
        os.kill(replica.engine.pid, signal.SIGKILL)
        assert wait_until(lambda: not replica.engine.is_alive(), timeout=5)
        with pytest.raises(RuntimeError, match="engine process"):
            replica.check_health()
    finally:
        for r in replicas:
            r.engine.shutdown()
