"""The overlap ("zero-overhead") scheduler: the CPU plans and launches step N+1 while the
GPU still runs step N, then processes step N's sampled tokens.

Step N+1 is planned before step N's tokens are known: a request that sampled in step N
counts one token in flight (`Request.inflight`), whose KV step N+1 computes. The host never
sees a value for it until step N is drained; step N+1's input reads it on the device from
step N's token tensor (`PendingTokens`). A request that turns out to have finished in step
N has already been given one more step: that step computes one KV entry nobody reads, and
its token is dropped.

Constrained requests (structured output) stay overlapped when jump-forward is off: their
token masks need the grammar state after step N's tokens, so in a step that samples one,
step N's tokens are taken in after step N+1's forward is launched but before its sampling
is (the GPU runs the forward meanwhile). With jump-forward on they step in sync: the text a
grammar forces after token N is only known once step N+1 has been planned without it, so
overlapped, every jump would cost its request one extra step.
Penalties need no host work: the sampler counts each request's tokens on the device
(engine/executor/penalties.py), the one in flight included; logprobs and prompt logprobs are copied
back with the tokens and taken in at the drain.

The stepper also runs on CPUs (no events, no pinned memory), where it overlaps nothing but
exercises the same bookkeeping; the engine only turns it on for CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from engine.executor.step_input import PendingTokens
from engine.core.token_update import TokenUpdate
from engine.executor.prompt_logprobs import PromptScores
from engine.core.request import Request, Status
from engine.core.step_plan import Chunk, StepPlan
from engine.executor.staging import take_rows, to_host

if TYPE_CHECKING:
    from engine.core.scheduler import Scheduler
    from engine.executor.model_runner import ModelRunner
    from engine.executor.output_processor import OutputProcessor
    from engine.executor.sampler import Sampler


class SyncFallback(Protocol):
    """The plain step loop (engine/runtime/sync_step.py's SyncStepper, a neighbour in this
    room, hence named by use): the parts it was built with, and its step."""

    scheduler: Scheduler
    runner: ModelRunner
    processor: OutputProcessor
    sampler: Sampler

    def step(self) -> list[TokenUpdate]: ...


def needs_sync(req: Request, jump_forward: bool) -> bool:
    return req.params.has_constraint and jump_forward


@dataclass
class InFlight:
    """A launched step whose sampled tokens are still on their way to the host."""

    plan: StepPlan
    reqs: list[Request]  # the requests that sampled, in the order of `tokens`
    tokens: torch.Tensor | None  # [len(reqs)] on the device
    host: torch.Tensor | None  # [len(reqs)] (pinned on CUDA), filled by a non-blocking copy
    done: torch.cuda.Event | None  # None on CPU, where the copy is done when issued
    # When a request asked for logprobs: the sampler's (chosen, top values, top ids) for
    # every row, copied back the same way (as the sync stepper, every row gets them)
    logprobs: tuple | None = None
    prompt: PromptScores | None = None  # the step's prompt logprobs, copied back the same way

    def pending(self) -> PendingTokens | None:
        if self.tokens is None:
            return None
        return PendingTokens(self.tokens, {req: k for k, req in enumerate(self.reqs)})


class OverlapStepper:
    def __init__(self, sync: SyncFallback, max_batch: int) -> None:
        self.sync = sync
        self.scheduler = sync.scheduler
        self.runner = sync.runner
        self.processor = sync.processor
        self.inflight: InFlight | None = None
        self.cuda = self.runner.device.type == "cuda"
        # Two host buffers, alternating: step N+2 reuses step N's only after draining it.
        self._host = [torch.empty(max_batch, dtype=torch.long, pin_memory=self.cuda)
                      for _ in range(2)]
        self._launches = 0

    @property
    def busy(self) -> bool:
        return self.inflight is not None

    def step(self) -> list[TokenUpdate]:
        sched = self.scheduler
        jump = self.processor.grammars.enable_jump_forward
        if any(needs_sync(r, jump) for r in sched.running) or \
                any(needs_sync(r, jump) for r in sched.waiting):
            return self.drain() + self.sync.step()
        plan = sched.schedule()
        if plan is None:
            return self.drain()
        logits, chunks, prompt = self._forward(plan)
        if any(c.req.grammar is not None for c in chunks):
            updates = self.drain()  # the grammars take in step N's tokens first
            launched, failed = self._sample(plan, logits, chunks, prompt, constrained=True)
            updates += failed
        else:
            launched, _ = self._sample(plan, logits, chunks, prompt, constrained=False)
            updates = self.drain()
        self.inflight = launched
        return updates

    def _forward(self, plan: StepPlan) -> tuple[torch.Tensor, list[Chunk], PromptScores]:
        """Launch the forward; its logits rows are the plan's sampling chunks, in order, and
        the step's prompt logprobs still on the device."""
        pending = self.inflight.pending() if self.inflight is not None else None
        logits, prompt = self.runner.forward(plan, pending)
        sampling = [i for i, c in enumerate(plan.chunks) if c.samples]
        return take_rows(logits, sampling), [plan.chunks[i] for i in sampling], prompt

    def _sample(self, plan: StepPlan, logits: torch.Tensor, chunks: list[Chunk],
                prompt: PromptScores, constrained: bool) -> tuple[InFlight, list[TokenUpdate]]:
        """Launch sampling for the chunks that still sample, under their grammar masks when
        `constrained`; returns the in-flight step and updates for requests whose grammar
        failed to compile."""
        masks, failed = None, []
        if constrained:
            # Step N's tokens were just taken in: a request may have finished (or been
            # extended, were jump-forward on: then its chunk no longer ends its tokens).
            live = [j for j, c in enumerate(chunks) if c.req.status is Status.RUNNING and c.samples]
            masks, failed = self.processor.grammars.token_masks([chunks[j].req for j in live])
            if failed:
                keep = [k for k, j in enumerate(live) if chunks[j].req not in failed]
                live = [live[k] for k in keep]
                masks = masks[keep] if masks is not None else None
            logits = take_rows(logits, live)
            chunks = [chunks[j] for j in live]
        reqs = [c.req for c in chunks]
        tokens = host = logprobs = None
        if reqs:
            tokens = self.sync.sampler.sample_tokens(logits, reqs, masks)
            host = self._host[self._launches % 2][:len(reqs)]
            host.copy_(tokens, non_blocking=self.cuda)
            params = [r.params for r in reqs]
            if any(p.logprobs or p.top_logprobs for p in params):
                raw = torch.log_softmax(logits, dim=-1)  # before penalties and masks
                logprobs = tuple(to_host(t) for t in
                                 self.sync.sampler.logprobs_on_device(raw, tokens, params))
        scores = prompt.to_host() if prompt.owners else None
        self._launches += 1
        done = None
        if self.cuda:  # after every copy above: the drain waits on it
            done = torch.cuda.Event()
            done.record()
        for req in reqs:
            req.inflight += 1
        return (InFlight(plan, reqs, tokens, host, done, logprobs, scores),
                self.processor.abort_failed(failed))

    def drain(self) -> list[TokenUpdate]:
        """Wait for the in-flight step and take its tokens in."""
        f, self.inflight = self.inflight, None
        if f is None:
            return []
        if f.done is not None:
            f.done.synchronize()
        if f.prompt is not None:
            self.processor.take_prompt_logprobs(f.prompt.resolve())
        values = f.host.tolist() if f.host is not None else []
        chosen = top = None
        if f.logprobs is not None:
            chosen, top = self.sync.sampler.logprobs_to_lists(*f.logprobs,
                                                              [r.params for r in f.reqs])
        taken = []
        for k, (req, token) in enumerate(zip(f.reqs, values)):
            if req.status is Status.FINISHED:  # aborted, or finished by its previous token
                continue
            req.inflight -= 1
            req.token_ids.append(token)
            if chosen is not None:
                req.output_logprobs.append(chosen[k])
            if top is not None:
                req.output_top_logprobs.append(top[k])
            taken.append((req, token))
        self.processor.cache_prefill_chunks(f.plan)
        # Jump-forward only without a later token in flight (the next step computed its
        # logits after this token; constrained steps take tokens in before sampling).
        return [self.processor.advance(req, token, may_jump=not req.inflight)
                for req, token in taken]
