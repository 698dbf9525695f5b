"""The Serve test files that tests/test_serve_throughput_mode.py runs under Ray Serve's high
throughput mode, in one pytest subprocess with the mode's variables set (Serve reads them
when the cluster and each of its processes start, so they cannot be switched inside one test
process).

The subprocess mostly waits (cluster, Serve and app start-ups), so tests/conftest.py starts
it as the session starts, beside the files that need no Ray, and the test collects its
result when its turn comes. It serves on a free port and runs HAProxy on ports and sockets of
its own, so it shares nothing with the session's own clusters. It has timeouts and health
checks to meet (Serve ends an HAProxy that misses three) and the session's CPU-bound tests
have none, so the CPU goes to it first: its Ray workers run at niceness 0 (Ray starts them
at 15, below any busy process) and the session at 5 until the run has ended. Meanwhile the
session's torch runs on one thread: two OpenMP threads on a box whose other core is busy at a
higher priority wait at every op's barrier for the one descheduled (four host-tier tests:
103 s with two threads beside one busy process, 16 s with one, 17 s alone with two).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
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
SESSION_NICENESS = 5  # the session's priority below the subprocess's while both run
TIMEOUT_S = 1500


def mode_files() -> list[str]:
    """The files to run: RADIXSERVE_THROUGHPUT_MODE_FILES (comma-separated) or the default."""
    names = os.environ.get("RADIXSERVE_THROUGHPUT_MODE_FILES", DEFAULT_FILES)
    return [f.strip() for f in names.split(",") if f.strip()]


@dataclass
class ModeFilesRun:
    proc: subprocess.Popen
    log: Path
    workdir: tempfile.TemporaryDirectory

    def result(self) -> tuple[int, str]:
        """(return code, output) once the subprocess has ended."""
        try:
            code = self.proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = -1
        finally:
            self.stop()
        return code, self.log.read_text(errors="replace")

    def stop(self) -> None:
        """End the subprocess and every process its Ray cluster started."""
        kill_session(self.proc.pid)
        self.proc.wait(timeout=30)


def start() -> ModeFilesRun:
    """Start the files' pytest under the mode (output to a file, not a pipe nobody reads)."""
    # Short: Serve puts HAProxy's sockets in a folder per node id (56 characters) under it,
    # and a Unix socket's path may not pass 107.
    workdir = tempfile.TemporaryDirectory(prefix="rsm-", dir="/tmp")
    env = dict(os.environ, **THROUGHPUT_MODE_ENV, **private_haproxy_env(Path(workdir.name)),
               RADIXSERVE_TEST_PORT=str(free_port()), OMP_NUM_THREADS="1",
               RAY_worker_niceness="0")
    log = Path(workdir.name) / "pytest.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
             *(f"tests/{f}" for f in mode_files())],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return ModeFilesRun(proc, log, workdir)


_started: ModeFilesRun | None = None
_session_threads: int | None = None  # the session's torch threads while it yields, else None


def start_in_background() -> None:
    """Start the run now, for `take()` to collect later; lower this process's priority and
    run its torch on one thread until the run has ended."""
    global _started, _session_threads
    import torch

    _started = start()
    os.nice(SESSION_NICENESS)
    _session_threads = torch.get_num_threads()
    torch.set_num_threads(1)


def restore_priority_once_ended() -> None:
    """The session's priority and torch threads back once the background run has ended
    (called between tests, on the main thread: a niceness is a thread's, and new threads and
    processes inherit it)."""
    global _session_threads
    if _session_threads is None or (_started is not None and _started.proc.poll() is None):
        return
    import torch

    torch.set_num_threads(_session_threads)
    _session_threads = None
    try:
        os.nice(-SESSION_NICENESS)
    except PermissionError:  # raising a priority needs privileges: the session stays lower
        pass


def take() -> ModeFilesRun:
    """The run started in the background, else one started now."""
    global _started
    run, _started = _started, None
    return run or start()


def stop_background() -> None:
    """End a background run that no test collected (a session ended early)."""
    global _started
    if _started is not None:
        _started.stop()
        _started = None
