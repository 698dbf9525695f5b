"""Engine threads stop before the interpreter finalizes.

An engine thread is a daemon thread that spends its time in torch ops. When the process
exits while one is inside a step, finalization tears it down mid-op: the process aborts
("terminate called without an active exception") or crashes instead of exiting with its
own status. So each thread that steps an engine registers its owner here, and one atexit
handler asks every owner still alive to stop; atexit runs before finalization, while the
threads can still finish their step and return.
"""
from __future__ import annotations

import atexit
import time
import weakref
from typing import Protocol

EXIT_WAIT_S = 10.0  # for all of them together: a step in progress finishes well within it


class Stoppable(Protocol):
    def shutdown(self, timeout: float) -> None:
        """Ask the thread to stop after its current step; wait up to `timeout` seconds."""


_owners: weakref.WeakSet = weakref.WeakSet()  # an owner that was collected has no thread to stop


def stop_at_exit(owner: Stoppable) -> None:
    _owners.add(owner)


def stop_all(wait_s: float = EXIT_WAIT_S) -> None:
    deadline = time.monotonic() + wait_s
    for owner in list(_owners):
        owner.shutdown(max(0.0, deadline - time.monotonic()))


atexit.register(stop_all)
