"""TargetRunner: what speculative decoding uses of the target's model runner
(engine/executor/model_runner.py), which the engine builds and hands in. Named by use so
that engine/speculative/ sits below the runner's module."""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class KVSlots(Protocol):
    num_slots: int


class GraphLimits(Protocol):
    """The extend graphs' limits (0 when there are none)."""

    max_extend_bs: int  # requests
    max_extend_tokens: int


class TargetRunner(Protocol):
    vocab_size: int
    max_context: int
    kv_pool: KVSlots
    load_model: Callable
    graphs: GraphLimits | None
