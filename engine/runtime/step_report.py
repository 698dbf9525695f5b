"""What a server reads from the engine after each step: `StepReport`, the same whether the
engine runs on a thread (AsyncEngine) or in a process of its own (ProcessAsyncEngine)."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.runtime.engine import Engine


@dataclass
class StepReport:
    """After a step (or a batch of commands): the radix cache's events since the last
    report, the engine's stats (None: unchanged since the last report), and the grammar
    compile times since the last report."""

    cache_events: list = field(default_factory=list)
    stats: dict | None = None
    grammar_compile_times: list[float] = field(default_factory=list)


def step_report(engine: Engine, last_stats: dict | None = None) -> StepReport:
    """Drain the engine's per-step data; stats only when they differ from `last_stats`."""
    stats = engine.stats()
    return StepReport(engine.drain_cache_events(), None if stats == last_stats else stats,
                      engine.drain_grammar_compile_times())
