"""ProcessAsyncEngine, what only the child-process transport has: a dead child ends its
streams with an error (never a hang), a dead parent leaves no orphan child, the child's
loop ends a failed step's requests with an error that crosses the pipe, and tp_size > 1
is refused. The EngineClient contract it shares with AsyncEngine (outputs, aborts, bad
requests, capacity, the wire form, start-up errors): tests/test_engine_client.py."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from engine import EngineConfig, EngineProcessError, ProcessAsyncEngine, SamplingParams
from serve_helpers import ROOT, wait_until

GREEDY = dict(temperature=0.0, ignore_eos=True)


def config(model: str, **kw) -> EngineConfig:
    return EngineConfig(**{"model": model, "dtype": "float32", "max_total_tokens": 1024,
                           "chunked_prefill_size": 32, **kw})


def run(coro):
    return asyncio.run(coro)


def assert_no_leak(stats):
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["free_slots"] + stats["evictable_slots"] == stats["total_slots"]


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
    deltas = [d for m in messages for d in m.deltas]
    assert [s for m in messages for s in m.delta_seqs] == [7]
    assert len(deltas) == 1 and len(deltas[0].token_ids) == 1  # the first step's token, then the error
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
        assert wait_until(lambda: not _alive(child_pid), timeout=30), "the engine process outlived its parent"
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    """Running (a zombie, reaped by init soon, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
