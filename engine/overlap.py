"""The overlap ("zero-overhead") scheduler: the CPU plans and launches step N+1 while the
GPU still runs step N, then processes step N's sampled tokens.

Step N+1 is planned before step N's tokens are known, so a request that sampled in step N
carries a placeholder (a negative id, -(k+1) for row k of step N's token tensor) as its
last token; the runner swaps placeholders for the real ids on the GPU. A request that turns
out to have finished in step N has already been given one more step: that step computes
one KV entry nobody reads, and its token is dropped.

Requests that need host-side work between steps (logprobs, penalties, grammar masks,
prompt logprobs) turn overlap off while they are present; the engine then steps in sync.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request, Status
from engine.scheduler import StepPlan


def needs_sync(req: Request) -> bool:
    p = req.params
    return bool(p.logprobs or p.top_logprobs or p.has_penalties or p.has_constraint
                or p.prompt_logprobs_start is not None)


@dataclass
class InFlight:
    """A launched step whose sampled tokens are still on their way to the host."""

    plan: StepPlan
    tokens: torch.Tensor | None  # [k] on the device
    host: torch.Tensor | None  # pinned [k], filled by a non-blocking copy
    done: torch.cuda.Event
    placeholders: list[tuple[Request, int]]  # (request, index in its token_ids)


class OverlapStepper:
    def __init__(self, engine, max_batch: int) -> None:
        self.engine = engine
        self.inflight: InFlight | None = None
        # Two pinned buffers, alternating: step N+2 reuses step N's only after draining it.
        self._host = [torch.empty(max_batch, dtype=torch.long, pin_memory=True) for _ in range(2)]
        self._launches = 0

    @property
    def busy(self) -> bool:
        return self.inflight is not None

    def step(self) -> list:
        eng = self.engine
        sched = eng.scheduler
        if any(needs_sync(r) for r in sched.running) or any(needs_sync(r) for r in sched.waiting):
            return self.drain() + eng._step_sync()
        plan = sched.schedule()
        if plan is None:
            return self.drain()
        eng.num_steps += 1
        launched = self._launch(plan)
        updates = self.drain()
        self.inflight = launched
        return updates

    def _launch(self, plan: StepPlan) -> InFlight:
        eng = self.engine
        runner = eng.runner
        runner.placeholder_tokens = self.inflight.tokens if self.inflight else None
        logits, _ = runner.forward(plan)
        runner.placeholder_tokens = None
        sampling = [i for i, c in enumerate(plan.chunks) if c.samples]
        reqs = [plan.chunks[i].req for i in sampling]
        tokens = host = None
        if reqs:
            if len(sampling) < len(plan.chunks):
                logits = logits[sampling]
            tokens = eng.sampler.sample_tokens(logits, reqs)
            host = self._host[self._launches % 2][:len(reqs)]
            host.copy_(tokens, non_blocking=True)
        self._launches += 1
        done = torch.cuda.Event()
        done.record()
        placeholders = []
        for k, req in enumerate(reqs):
            req.token_ids.append(-(k + 1))
            placeholders.append((req, len(req.token_ids) - 1))
        return InFlight(plan, tokens, host, done, placeholders)

    def drain(self) -> list:
        """Wait for the in-flight step and apply its tokens."""
        from engine.engine import TokenUpdate

        f, self.inflight = self.inflight, None
        if f is None:
            return []
        f.done.synchronize()
        values = f.host.tolist() if f.host is not None else []
        for (req, pos), token in zip(f.placeholders, values):
            if pos < len(req.token_ids):  # else aborted meanwhile and trimmed
                req.token_ids[pos] = token
        eng = self.engine
        for chunk in f.plan.chunks:
            if chunk.num_tokens > 1 and chunk.req.status is Status.RUNNING:
                eng.scheduler.cache_prefix(chunk.req)
        updates = []
        for (req, pos), token in zip(f.placeholders, values):
            if req.status is Status.FINISHED:  # aborted while in flight
                continue
            eng.scheduler.stats.generated_tokens += 1
            # Judge the request by its tokens up to this one, not the next step's placeholder.
            ahead = req.token_ids[pos + 1:]
            del req.token_ids[pos + 1:]
            reason = eng._finish_reason(req, token)
            if reason is None:
                req.token_ids += ahead
            else:
                eng.scheduler.finish(req, reason)
            updates.append(TokenUpdate(req, [token], reason is not None))
        return updates
