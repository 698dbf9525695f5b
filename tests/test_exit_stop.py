"""engine/runtime/exit_stop.py: a process that exits while its engine thread is inside a
step exits with its own status. Left to finalization, a thread torn down mid-op aborts the
process ("terminate called without an active exception")."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Keeps an in-thread engine stepping four requests and exits while it steps.
SCRIPT = """
import asyncio, sys, threading, time
from engine import AsyncEngine, EngineConfig, SamplingParams

loop = asyncio.new_event_loop()
threading.Thread(target=loop.run_forever, daemon=True).start()
generator = AsyncEngine(EngineConfig(model=sys.argv[1], device="cpu"))
params = SamplingParams(max_tokens=400, ignore_eos=True)
for i in range(4):
    generator._commands.put(lambda i=i: generator.engine.add_request(f"r{i}", [5, 6, 7] * 30, params))

def running():
    return asyncio.run_coroutine_threadsafe(generator.stats(), loop).result()["running"]

deadline = time.monotonic() + 60
while running() < 4:
    assert time.monotonic() < deadline, "the engine never got busy"
    time.sleep(0.05)
print("exiting while it steps", flush=True)
"""


def test_exiting_while_the_engine_thread_steps_exits_cleanly(tiny_qwen3):
    done = subprocess.run([sys.executable, "-c", SCRIPT, tiny_qwen3], cwd=ROOT, capture_output=True,
                          text=True, timeout=180)
    assert "exiting while it steps" in done.stdout, done.stderr[-3000:]
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
