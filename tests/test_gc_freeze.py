"""engine/runtime/gc_freeze.py: the engine freezes what is alive after start-up (full collections
skip it) and unfreezes when it is freed, so a dropped engine's weights, which sit in
reference cycles, are still reclaimed."""
from __future__ import annotations

import gc
import weakref

from engine.config import EngineConfig
from engine.loading.demo_model import ensure_demo_model
from engine.runtime.engine import Engine


def _engine(**kw) -> Engine:
    return Engine(EngineConfig(model=ensure_demo_model(), dtype="float32", device="cpu",
                               max_total_tokens=4096, **kw))


def test_frozen_after_start_and_reclaimed_when_dropped(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_GC_FREEZE", "1")
    gc.unfreeze()
    engine = _engine()
    assert gc.get_freeze_count() > 1000  # the libraries and the engine itself
    model = engine.runner.model
    assert not any(o is model for o in gc.get_objects())  # frozen: collections skip it
    weight = weakref.ref(next(model.parameters()))
    del model
    del engine
    assert gc.get_freeze_count() == 0  # unfrozen as the engine was freed
    gc.collect()
    assert weight() is None  # the weights' cycles were collected, not leaked


def test_off_freezes_nothing(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_GC_FREEZE", "1")
    gc.unfreeze()
    engine = _engine(freeze_gc_after_start=False)
    assert gc.get_freeze_count() == 0
    del engine
