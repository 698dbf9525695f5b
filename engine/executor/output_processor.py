"""Taking in what a step produced: sampled tokens (appended, checked against the grammar,
extended by jump-forward, judged for stops and limits) and prompt logprobs. One
`OutputProcessor` serves the sync loop (engine/runtime/sync_step.py) and the overlap loop
(engine/runtime/overlap.py), so both finish requests by the same rules."""
from __future__ import annotations

import torch

from engine.grammar import Grammars
from engine.core.request import Request, Status
from engine.executor.sampler import Sampler
from engine.core.scheduler import Scheduler
from engine.executor.staging import take_rows
from engine.core.step_plan import StepPlan
from engine.core.token_update import TokenUpdate


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, grammars: Grammars, eos_token_ids,
                 max_context: int) -> None:
        self.scheduler = scheduler
        self.grammars = grammars
        self.eos_token_ids = eos_token_ids
        self.max_context = max_context
        self.num_jump_forward_tokens = 0  # output tokens appended by jump-forward, not decoded

    def sample_and_take(self, plan: StepPlan, logits: torch.Tensor,
                        sampler: Sampler) -> list[TokenUpdate]:
        """Sample the chunks that reached the end of their tokens (`logits`: one row per
        chunk) and take the tokens in."""
        sampling = [i for i, c in enumerate(plan.chunks) if c.samples]
        reqs = [plan.chunks[i].req for i in sampling]
        logits = take_rows(logits, sampling)
        # Constrained rows: tokens their grammar allows next (matchers are up to date: they
        # advance as tokens are appended, below).
        masks, failed = self.grammars.token_masks(reqs) if sampling else (None, [])
        out = sampler.sample(logits, reqs, masks) if sampling else None
        self.cache_prefill_chunks(plan)
        updates = self.abort_failed(failed)
        for j, req in enumerate(reqs):
            if req.status is not Status.RUNNING:
                continue
            token = out.token_ids[j]
            req.token_ids.append(token)
            if out.logprobs is not None:
                req.output_logprobs.append(out.logprobs[j])
            if out.top_logprobs is not None:
                req.output_top_logprobs.append(out.top_logprobs[j])
            updates.append(self.advance(req, token))
        return updates

    def cache_prefill_chunks(self, plan: StepPlan) -> None:
        """Share each prefill chunk's KV with later arrivals (radix tree)."""
        for chunk in plan.chunks:
            if chunk.num_tokens > 1 and chunk.req.status is Status.RUNNING:
                self.scheduler.cache_prefix(chunk.req)

    def abort_failed(self, failed: list[Request]) -> list[TokenUpdate]:
        """Requests added without validate() whose constraint did not compile."""
        for req in failed:
            self.scheduler.finish(req, "abort")
        return [TokenUpdate(req, [], True) for req in failed]

    @staticmethod
    def take_prompt_logprobs(rows: list[tuple[Request, int, float, list | None]]) -> None:
        for req, pos, value, top in rows:
            req.prompt_logprobs[pos] = value
            if top is not None:
                req.prompt_top_logprobs[pos] = top
            req.prompt_logprobs_next = pos + 1

    def advance(self, req: Request, token: int, may_jump: bool = True) -> TokenUpdate:
        """Take in `token`, just appended as the request's last: advance its grammar,
        append what the grammar forces next (jump-forward, unless `may_jump` is False),
        and finish the request if it is done."""
        stats = self.scheduler.stats
        stats.generated_tokens += 1
        if req.grammar is not None and not self.grammars.accept(req, token):
            reason = "abort"  # the mask allowed what the grammar refuses: a bug (logged)
        else:
            reason = self.finish_reason(req, token)
        new_tokens = [token]
        if reason is None and req.grammar is not None and may_jump:
            # Append the text the grammar forces without decoding it; the next step
            # computes its KV as one chunk and samples after it.
            room = min(req.params.max_tokens - req.num_output,
                       self.max_context - len(req.token_ids))
            jumped = self.grammars.jump_forward(req, token, room)
            if jumped:
                req.token_ids += jumped
                new_tokens += jumped
                self.num_jump_forward_tokens += len(jumped)
                stats.generated_tokens += len(jumped)
                reason = self.finish_reason(req, jumped[-1])
        if reason is not None:
            self.scheduler.finish(req, reason)
        return TokenUpdate(req, new_tokens, reason is not None)

    def finish_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in p.stop_token_ids:
            return "stop"
        if req.grammar is not None and self.grammars.is_terminated(req):
            return "stop"
        if p.stop:
            feed_detokenizer(req)
            if req.detok.stopped:
                return "stop"
        if req.num_output >= p.max_tokens or len(req.token_ids) >= self.max_context:
            return "length"
        return None


def feed_detokenizer(req: Request) -> None:
    """Bring the request's detokenizer up to its tokens. Output text is decoded lazily,
    off the step loop, except for requests with stop strings."""
    req.detok.catch_up(req.output_ids)
