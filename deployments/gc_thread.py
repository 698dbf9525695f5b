"""Cyclic garbage collection on a thread of its own in each Serve replica, instead of inside
whatever allocation crosses the collector's threshold.

CPython can crash when an automatic collection starts inside `ContextVar.set`: the HAMT node
that the set allocates triggers it, a finalizer that the collection runs sets a variable of
the same context, and the set in progress goes on walking the HAMT that the finalizer freed
(python/cpython#148891; reproduced on 3.10 and 3.11). Ray Serve sets context variables around
every request, and its streaming generators have finalizers: under hundreds of concurrent
streams on a 2-core box, replicas died with SIGSEGV in `hamt_node_bitmap_assoc` called from
Serve's request wrapper. A thread that does nothing but collect is never inside a set when
its own collection runs, and a collection elsewhere cannot start while automatic collection
is off. The thread applies the collector's own thresholds, so collections come as often.
At exit it stops and automatic collection resumes, so that no finalizer runs on a daemon
thread while the interpreter (and Ray's driver state) is being torn down.
"""
from __future__ import annotations

import atexit
import gc
import threading

PERIOD_S = 0.01  # how often the thread looks at the allocation counts (short: a collection
# of what piles up between looks holds the GIL the longer)
_started = threading.Event()
_stopping = threading.Event()


def collect_due(thresholds: tuple[int, int, int]) -> int | None:
    """Collect the oldest generation whose count is past its threshold, as the automatic
    collector would; the generation collected, or None."""
    counts = gc.get_count()
    for generation in (2, 1, 0):
        if counts[generation] > thresholds[generation]:
            gc.collect(generation)
            return generation
    return None


def collect_on_own_thread(period_s: float = PERIOD_S) -> None:
    """Turn automatic collection off for this process and collect on a daemon thread
    (once per process; later calls do nothing)."""
    if _started.is_set():
        return
    _started.set()
    thresholds = gc.get_threshold()
    gc.disable()

    def run() -> None:
        while not _stopping.wait(period_s):
            collect_due(thresholds)

    thread = threading.Thread(target=run, name="radixserve-gc", daemon=True)
    thread.start()
    atexit.register(_stop_collecting, thread)


def _stop_collecting(thread: threading.Thread) -> None:
    _stopping.set()
    thread.join(1.0)
    gc.enable()
