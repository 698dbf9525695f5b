"""deployments/gc_thread.py: Serve replicas collect cyclic garbage on a thread of their own
(automatic collection could start inside a ContextVar.set: python/cpython#148891)."""
from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from pathlib import Path

from deployments.gc_thread import collect_due

ROOT = Path(__file__).resolve().parents[1]


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_collects_the_oldest_generation_past_its_threshold():
    gc.collect()
    cycle = Node()
    alive = weakref.ref(cycle)
    del cycle
    huge = 10 ** 9
    assert collect_due((huge, huge, huge)) is None and alive() is not None
    assert collect_due((-1, huge, huge)) == 0 and alive() is None
    assert collect_due((-1, -1, huge)) == 1
    assert collect_due((-1, -1, -1)) == 2


def test_a_replica_process_collects_on_its_thread_with_automatic_collection_off():
    """...until it exits: then the thread stops and automatic collection resumes."""
    code = """
import gc, threading, time, weakref
from deployments.gc_thread import collect_on_own_thread
class Node:
    def __init__(self): self.me = self
collect_on_own_thread(period_s=0.01)
collect_on_own_thread(period_s=0.01)
assert not gc.isenabled()
assert [t.name for t in threading.enumerate()].count("radixserve-gc") == 1
refs = []
for _ in range(5000):  # past the generation-0 threshold many times over
    n = Node()
    refs.append(weakref.ref(n))
    del n
deadline = time.monotonic() + 5
while any(r() is not None for r in refs) and time.monotonic() < deadline:
    time.sleep(0.01)
print(sum(r() is not None for r in refs))
import atexit
atexit._run_exitfuncs()  # what the interpreter runs first as it exits
assert gc.isenabled() and "radixserve-gc" not in [t.name for t in threading.enumerate()]
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "0"  # every cycle freed, by the thread alone
