"""`serve run serve_config.yaml` as a user runs it: a subprocess that comes up and answers."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from serve_helpers import ROOT, served_model_name, wait_until


def _kill_session(sid: int) -> None:
    """Ray's workers start process groups of their own: end every process of the session."""
    out = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True).stdout
    for line in out.splitlines():
        pid, psid = (int(x) for x in line.split())
        if psid == sid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def serve_run():
    import ray

    if ray.is_initialized():  # another module's cluster would hold port 8000
        pytest.fail("a Ray cluster is still running in the test process")
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(ROOT))
    serve_bin = os.path.join(os.path.dirname(sys.executable), "serve")
    proc = subprocess.Popen([serve_bin, "run", "serve_config.yaml"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    yield proc
    _kill_session(proc.pid)
    proc.wait(timeout=30)
    time.sleep(1)


def test_serve_run_comes_up_and_answers(serve_run):
    def ready():
        if serve_run.poll() is not None:
            return "exited"
        try:
            return httpx.get("http://127.0.0.1:8000/v1/models", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    state = wait_until(ready, timeout=150, interval=1)
    if state != True:  # noqa: E712
        out = serve_run.stdout.read().decode(errors="replace") if serve_run.poll() is not None else ""
        pytest.fail(f"serve run did not come up ({state}): {out[-3000:]}")
    r = httpx.post("http://127.0.0.1:8000/v1/completions", timeout=60,
                   json={"model": served_model_name(), "prompt": "Hello", "max_tokens": 5})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
