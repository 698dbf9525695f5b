"""The plain step loop: plan a step, run its forward, sample, take the tokens in, and only
then plan the next one. The overlap loop (engine/runtime/overlap.py) falls back on it for steps
whose requests need host-side work between steps."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine builds them and hands them in
    from engine.core.scheduler import Scheduler
    from engine.executor.model_runner import ModelRunner
    from engine.executor.output_processor import OutputProcessor, TokenUpdate
    from engine.executor.sampler import Sampler
    from engine.speculative.speculator import Speculator


class SyncStepper:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, sampler: Sampler,
                 processor: OutputProcessor, speculator: Speculator | None) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.processor = processor
        self.speculator = speculator

    @property
    def busy(self) -> bool:
        """Nothing is left in flight between two sync steps."""
        return False

    def step(self) -> list[TokenUpdate]:
        drafts = self.speculator.propose(self.scheduler.running) if self.speculator else None
        plan = self.scheduler.schedule(drafts)
        if plan is None:
            return []
        logits, prompt_logprobs = self.runner.forward(plan)
        self.processor.take_prompt_logprobs(prompt_logprobs.resolve())
        updates = []
        if self.speculator is not None and any(c.draft for c in plan.chunks):
            plan, logits, updates = self.speculator.take_verdicts(plan, logits, self.processor)
        return updates + self.processor.sample_and_take(plan, logits, self.sampler)
