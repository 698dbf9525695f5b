"""The Serve test files that tests/test_serve_throughput_mode.py runs under Ray Serve's high
throughput mode, in one pytest subprocess with the mode's variables set (Serve reads them
when the cluster and each of its processes start, so they cannot be switched inside one test
process).

The subprocess mostly waits (cluster, Serve and app start-ups), so tests/conftest.py starts
it as the session starts (from pytest-xdist's controller when the suite runs in lanes), and
the test collects its result when its turn comes. The run leaves its output, process id and
exit code in a folder of its own, so any process of the session can collect it. It serves on
a free port and runs HAProxy on ports and sockets of its own, so it shares nothing with the
session's own clusters. Its Ray workers run at niceness 0 (Ray starts them at 15, below any
busy process): it has timeouts and health checks to meet, the CPU-bound tests have none.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from serve_helpers import (
    ROOT,
    THROUGHPUT_MODE_ENV,
    free_port,
    kill_session,
    private_haproxy_env,
)

TEST_ID = "test_serve_throughput_mode.py::test_serve_test_files_under_the_mode"
DEFAULT_FILES = "test_serve_path.py,test_colocated_serve.py,test_readiness.py"
TIMEOUT_S = 1500
FOLDER: Path | None = None  # this session's run (tests/conftest.py sets it in pytest-xdist's workers)


def mode_files() -> list[str]:
    """The files to run: RADIXSERVE_THROUGHPUT_MODE_FILES (comma-separated) or the default."""
    names = os.environ.get("RADIXSERVE_THROUGHPUT_MODE_FILES", DEFAULT_FILES)
    return [f.strip() for f in names.split(",") if f.strip()]


def new_folder() -> Path:
    """A folder for one run. Short: Serve puts HAProxy's sockets in a folder per node id (56
    characters) under it, and a Unix socket's path may not pass 107."""
    return Path(tempfile.mkdtemp(prefix="rsm-", dir="/tmp"))


def start_once() -> bool:
    """Start this session's run unless it has started; True when this call started it."""
    global FOLDER
    FOLDER = FOLDER or new_folder()
    if (FOLDER / "pid").exists():
        return False
    start(FOLDER)
    return True


def start(folder: Path) -> None:
    """Start the files' pytest under the mode; it writes pytest.log, then rc when it ends."""
    env = dict(os.environ, **THROUGHPUT_MODE_ENV, **private_haproxy_env(folder),
               RADIXSERVE_TEST_PORT=str(free_port()), OMP_NUM_THREADS="1",
               RAY_worker_niceness="0")
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT"):
        env.pop(name, None)
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
              *(f"tests/{f}" for f in mode_files())]
    log, rc = shlex.quote(str(folder / "pytest.log")), shlex.quote(str(folder / "rc"))
    script = f"{shlex.join(pytest)} > {log} 2>&1; echo $? > {rc}.part && mv {rc}.part {rc}"
    proc = subprocess.Popen(["sh", "-c", script], cwd=ROOT, env=env, start_new_session=True)
    (folder / "pid").write_text(str(proc.pid))


def ended() -> bool:
    """Whether this session's run, if any, has ended."""
    return FOLDER is None or not (FOLDER / "pid").exists() or (FOLDER / "rc").exists()


def result(timeout: float = TIMEOUT_S) -> tuple[int, str]:
    """(exit code, output) of this session's run, started now unless it has been; the exit
    code is -1 when it ran past the timeout."""
    start_once()
    deadline = time.monotonic() + timeout
    while not ended() and time.monotonic() < deadline:
        time.sleep(1.0)
    stop()
    rc = FOLDER / "rc"
    code = int(rc.read_text()) if rc.exists() else -1
    return code, (FOLDER / "pytest.log").read_text(errors="replace")


def stop() -> None:
    """End the run and every process its Ray cluster started."""
    if not ended():
        kill_session(int((FOLDER / "pid").read_text()))


def remove() -> None:
    """Stop the run and remove its folder (the session's end)."""
    global FOLDER
    if FOLDER is not None:
        stop()
        shutil.rmtree(FOLDER, ignore_errors=True)
        FOLDER = None
