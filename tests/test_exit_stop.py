"""engine/runtime/exit_stop.py: a process that exits while its engine threads are inside a
step exits with its own status. Left to finalization, a thread torn down mid-op aborts the
process ("terminate called without an active exception")."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Builds both kinds of engine thread, keeps each busy, and exits while they step.
SCRIPT = """
import asyncio, sys, threading, time
from engine import AsyncEngine, AsyncPooling, EngineConfig, LLM, SamplingParams, embedding_inputs

loop = asyncio.new_event_loop()
threading.Thread(target=loop.run_forever, daemon=True).start()
generator = AsyncEngine(EngineConfig(model=sys.argv[1], device="cpu"))
params = SamplingParams(max_tokens=400, ignore_eos=True)
for i in range(4):
    generator._commands.put(lambda i=i: generator.engine.add_request(f"r{i}", [5, 6, 7] * 30, params))

embedder = LLM(sys.argv[1], task="embed").pooling.engine
pooling = AsyncPooling(embedder)
for i in range(200):
    asyncio.run_coroutine_threadsafe(pooling.run(embedding_inputs(embedder, [5, 6, 7] * 40)), loop)

deadline = time.monotonic() + 60
def running():
    return asyncio.run_coroutine_threadsafe(generator.stats(), loop).result()["running"]
while running() < 4 or pooling.waiting == 0:
    assert time.monotonic() < deadline, "the engines never got busy"
    time.sleep(0.05)
print("exiting while both step", flush=True)
"""


def test_exiting_while_engine_threads_step_exits_cleanly(tiny_qwen3):
    done = subprocess.run([sys.executable, "-c", SCRIPT, tiny_qwen3], cwd=ROOT, capture_output=True,
                          text=True, timeout=180)
    assert "exiting while both step" in done.stdout, done.stderr[-3000:]
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
