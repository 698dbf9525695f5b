"""The overlap ("zero-overhead") scheduler: the CPU plans and launches step N+1 while the
GPU still runs step N, then processes step N's sampled tokens.

Step N+1 is planned before step N's tokens are known, so a request that sampled in step N
carries a placeholder (a negative id, -(k+1) for row k of step N's token tensor) as its
last token; the runner swaps placeholders for the real ids on the GPU. A request that turns
out to have finished in step N has already been given one more step: that step computes
one KV entry nobody reads, and its token is dropped.

Constrained requests (structured output) stay overlapped when jump-forward is off: their
token masks need the grammar state after step N's tokens, so in a step that samples one,
step N's tokens are taken in after step N+1's forward is launched but before its sampling
is (the GPU runs the forward meanwhile). With jump-forward on they step in sync: the text a
grammar forces after token N is only known once step N+1 has been planned without it, so
overlapped, every jump would cost its request one extra step. Requests that need other
host-side work between steps (logprobs, penalties, prompt logprobs) turn overlap off too
while they are present.

The stepper also runs on CPUs (no events, no pinned memory), where it overlaps nothing but
exercises the same bookkeeping; the engine only turns it on for CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request, Status
from engine.scheduler import StepPlan


def needs_sync(req: Request, jump_forward: bool) -> bool:
    p = req.params
    return bool(p.logprobs or p.top_logprobs or p.has_penalties
                or p.prompt_logprobs_start is not None or (p.has_constraint and jump_forward))


@dataclass
class InFlight:
    """A launched step whose sampled tokens are still on their way to the host."""

    plan: StepPlan
    tokens: torch.Tensor | None  # [k] on the device
    host: torch.Tensor | None  # [k] (pinned on CUDA), filled by a non-blocking copy
    done: torch.cuda.Event | None  # None on CPU, where the copy is done when issued
    placeholders: list[tuple[Request, int]]  # (request, index in its token_ids)


class OverlapStepper:
    def __init__(self, engine, max_batch: int) -> None:
        self.engine = engine
        self.inflight: InFlight | None = None
        self.cuda = engine.runner.device.type == "cuda"
        # Two host buffers, alternating: step N+2 reuses step N's only after draining it.
        self._host = [torch.empty(max_batch, dtype=torch.long, pin_memory=self.cuda)
                      for _ in range(2)]
        self._launches = 0

    @property
    def busy(self) -> bool:
        return self.inflight is not None

    def step(self) -> list:
        eng = self.engine
        sched = eng.scheduler
        jump = eng.grammars.enable_jump_forward
        if any(needs_sync(r, jump) for r in sched.running) or \
                any(needs_sync(r, jump) for r in sched.waiting):
            return self.drain() + eng._step_sync()
        plan = sched.schedule()
        if plan is None:
            return self.drain()
        eng.num_steps += 1
        logits, chunks = self._forward(plan)
        if any(c.req.grammar is not None for c in chunks):
            updates = self.drain()  # the grammars take in step N's tokens first
            launched, failed = self._sample(plan, logits, chunks, constrained=True)
            updates += failed
        else:
            launched, _ = self._sample(plan, logits, chunks, constrained=False)
            updates = self.drain()
        self.inflight = launched
        return updates

    def _forward(self, plan: StepPlan) -> tuple[torch.Tensor, list]:
        """Launch the forward; its logits rows are the plan's sampling chunks, in order."""
        runner = self.engine.runner
        runner.placeholder_tokens = self.inflight.tokens if self.inflight else None
        logits, _ = runner.forward(plan)
        runner.placeholder_tokens = None
        sampling = [i for i, c in enumerate(plan.chunks) if c.samples]
        if len(sampling) < len(plan.chunks):
            logits = logits[sampling]
        return logits, [plan.chunks[i] for i in sampling]

    def _sample(self, plan: StepPlan, logits: torch.Tensor, chunks: list,
                constrained: bool) -> tuple[InFlight, list]:
        """Launch sampling for the chunks that still sample, under their grammar masks when
        `constrained`; returns the in-flight step and updates for requests whose grammar
        failed to compile."""
        from engine.engine import TokenUpdate

        eng = self.engine
        masks, failed = None, []
        if constrained:
            # Step N's tokens were just taken in: a request may have finished (or been
            # extended, were jump-forward on: then its chunk no longer ends its tokens).
            live = [j for j, c in enumerate(chunks) if c.req.status is Status.RUNNING and c.samples]
            masks, failed = eng.grammars.token_masks([chunks[j].req for j in live])
            for req in failed:  # added without validate() and its constraint did not compile
                eng.scheduler.finish(req, "abort")
            if failed:
                keep = [k for k, j in enumerate(live) if chunks[j].req not in failed]
                live = [live[k] for k in keep]
                masks = masks[keep] if masks is not None else None
            if len(live) < len(chunks):
                logits = logits[live]
            chunks = [chunks[j] for j in live]
        reqs = [c.req for c in chunks]
        tokens = host = None
        if reqs:
            tokens = eng.sampler.sample_tokens(logits, reqs, masks)
            host = self._host[self._launches % 2][:len(reqs)]
            host.copy_(tokens, non_blocking=self.cuda)
        self._launches += 1
        done = None
        if self.cuda:
            done = torch.cuda.Event()
            done.record()
        placeholders = []
        for k, req in enumerate(reqs):
            req.token_ids.append(-(k + 1))
            placeholders.append((req, len(req.token_ids) - 1))
        return (InFlight(plan, tokens, host, done, placeholders),
                [TokenUpdate(req, [], True) for req in failed])

    def drain(self) -> list:
        """Wait for the in-flight step and apply its tokens."""
        f, self.inflight = self.inflight, None
        if f is None:
            return []
        if f.done is not None:
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
            # Judge the request by its tokens up to this one, not the next step's placeholder.
            ahead = req.token_ids[pos + 1:]
            del req.token_ids[pos + 1:]
            # Jump-forward only without a next placeholder (the next step computed its
            # logits after this token; constrained steps take tokens in before sampling).
            update = eng._advance(req, token, may_jump=not ahead)
            if not update.finished:
                req.token_ids += ahead
            updates.append(update)
        return updates
