"""A streaming server's side of one engine step, the same whether the engine runs on a
thread (AsyncEngine) or in a process of its own (ProcessAsyncEngine's child): the step
(`step_for_streams`) and what the server reads from the engine after it (`StepReport`)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from engine.core.queue_deadlines import QUEUE_TIMEOUT

if TYPE_CHECKING:
    from engine.core.queue_deadlines import QueueTimeoutError
    from engine.core.request import Request
    from engine.core.sampling_params import SamplingParams
    from engine.core.token_update import TokenUpdate
    from engine.speculative.target import KVSlots

logger = logging.getLogger(__name__)


# What a streaming server's loop (this module, the engine process in engine_process_main.py)
# uses of the Engine (engine/runtime/engine.py), which is built above them and handed in.

class RunnerSizes(Protocol):
    vocab_size: int
    kv_pool: KVSlots


class ServedEngine(Protocol):
    requests: dict[str, Request]
    max_context: int
    runner: RunnerSizes

    @property
    def has_work(self) -> bool: ...

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    validated: bool = False) -> Request: ...

    def abort(self, request_id: str) -> Request | None: ...

    def step(self) -> list[TokenUpdate]: ...

    def abort_after_failed_step(self) -> list[Request]: ...

    def queue_timeout_error(self, req: Request) -> QueueTimeoutError: ...

    def stats(self) -> dict: ...

    def drain_cache_events(self) -> list: ...

    def drain_grammar_compile_times(self) -> list[float]: ...

    def close(self) -> None: ...


class EngineStepError(RuntimeError):
    """A step failed; the requests in it were ended, the engine lives on."""


@dataclass
class StepReport:
    """After a step (or a batch of commands): the radix cache's events since the last
    report, the engine's stats (None: unchanged since the last report), and the grammar
    compile times since the last report."""

    cache_events: list = field(default_factory=list)
    stats: dict | None = None
    grammar_compile_times: list[float] = field(default_factory=list)


def step_report(engine: ServedEngine, last_stats: dict | None = None) -> StepReport:
    """Drain the engine's per-step data; stats only when they differ from `last_stats`."""
    stats = engine.stats()
    return StepReport(engine.drain_cache_events(), None if stats == last_stats else stats,
                      engine.drain_grammar_compile_times())


def step_for_streams(engine: ServedEngine) -> tuple[list[TokenUpdate], list[tuple[Request, Exception]]]:
    """One engine step for a server that streams (AsyncEngine, the engine process): finished
    requests leave `engine.requests` (their streams have what they need), a request timed
    out in the queue ends with its QueueTimeoutError, and a step that raises ends the
    requests it leaves in doubt, each with an EngineStepError, instead of killing the loop."""
    try:
        updates = engine.step()
    except Exception as e:  # noqa: BLE001 - a bad step must not kill the engine
        logger.exception("engine step failed")
        return [], [(req, EngineStepError(f"engine step failed: {e}"))
                    for req in engine.abort_after_failed_step()]
    failed = []
    for update in updates:
        if update.finished:
            engine.requests.pop(update.req.request_id, None)
            if update.req.finish_reason == QUEUE_TIMEOUT:
                failed.append((update.req, engine.queue_timeout_error(update.req)))
    if failed:
        updates = [u for u in updates if u.req.finish_reason != QUEUE_TIMEOUT]
    return updates, failed
