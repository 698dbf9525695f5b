"""The plain step loop: plan a step, run its forward, sample, take the tokens in, and only
then plan the next one. The overlap loop (engine/runtime/overlap.py) falls back on it for steps
whose requests need host-side work between steps."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from engine.core.request import Request
    from engine.core.step_plan import StepPlan
    from engine.core.token_update import TokenUpdate


# What the step needs of the parts the engine builds and hands in (engine/core/scheduler.py,
# engine/executor/model_runner.py, output_processor.py, engine/speculative/speculator.py):
# named here, by use, so this module stays below them.

class StepScheduler(Protocol):
    running: list[Request]

    def schedule(self, drafts: dict[Request, list[int]] | None = None) -> StepPlan | None: ...


class PromptScoresLike(Protocol):
    def resolve(self) -> list: ...


class StepRunner(Protocol):
    def forward(self, plan: StepPlan) -> tuple[torch.Tensor, PromptScoresLike]: ...


class StepProcessor(Protocol):
    def take_prompt_logprobs(self, rows: list) -> None: ...

    def sample_and_take(self, plan: StepPlan, logits: torch.Tensor,
                        sampler: object) -> list[TokenUpdate]: ...


class StepSpeculator(Protocol):
    def propose(self, running: list[Request]) -> dict[Request, list[int]]: ...

    def take_verdicts(self, plan: StepPlan, logits: torch.Tensor, processor: StepProcessor
                      ) -> tuple[StepPlan, torch.Tensor, list[TokenUpdate]]: ...


class SyncStepper:
    def __init__(self, scheduler: StepScheduler, runner: StepRunner, sampler: object,
                 processor: StepProcessor, speculator: StepSpeculator | None) -> None:
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
