"""Runs of pytest in fresh processes that skip the start-up: one server process imports pytest,
torch, triton and the engine once, then forks a child per run (a fresh process as far as the
run can tell: its own modules, environment and exit). The suite's ~15 Triton interpreter runs
(tests/triton_on_cpu.py) each paid 4-6 s of imports on a 2-core box before.

    python tests/pytest_fork_server.py    # reads a JSON list of pytest arguments per line,
                                          # answers {"rc": ..., "out": ...} per line
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class ForkServer:
    """The client: one server per environment, started on first use, ended with its stdin."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.proc: subprocess.Popen | None = None

    def run(self, args: list[str], timeout: float) -> tuple[int, str]:
        """(exit code, output) of `pytest args` in a forked child; the server is killed (and
        started again next time) if the run outlasts `timeout`."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, __file__], cwd=ROOT, env=self.env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                         start_new_session=True)  # a group with its children
        self.proc.stdin.write(json.dumps(args) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            return -1, f"no answer from the fork server within {timeout} s"
        reply = json.loads(line)
        return reply["rc"], reply["out"]


def _run_child(args: list[str], out_fd: int) -> None:
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    import pytest

    code = pytest.main(args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))


def serve() -> None:
    sys.path.insert(0, str(ROOT))
    import pytest  # noqa: F401 - imported once, for every child
    import torch  # noqa: F401
    import triton  # noqa: F401

    import engine  # noqa: F401

    for line in sys.stdin:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            _run_child(json.loads(line), write_fd)
        os.close(write_fd)
        with os.fdopen(read_fd, encoding="utf-8", errors="replace") as pipe:
            out = pipe.read()
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status), "out": out}), flush=True)


if __name__ == "__main__":
    serve()
