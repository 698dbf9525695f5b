"""The engine's speculative-decoding side: which requests draft, their drafts, and the
verdict on them. The engine feeds the drafts to the target after each request's last
token (`Scheduler.schedule(drafts)`: KV slots for them when memory allows), then takes in
the verified tokens and frees the KV of the rejected drafts (`Speculator.take_verdicts`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.config import EngineConfig
from engine.grammar import Grammars
from engine.executor.output_processor import OutputProcessor
from engine.core.token_update import TokenUpdate
from engine.core.request import Request
from engine.executor.sampler import Sampler
from engine.core.step_plan import Chunk, StepPlan
from engine.speculative.constrained import cut_to_grammar, verify_masks
from engine.speculative.positions import TokenLogprobs, penalized, token_logprobs
from engine.speculative.proposer import Proposer
from engine.core.spec_stats import SpecStats
from engine.speculative.verify import verify_chunks

if TYPE_CHECKING:
    from engine.speculative.target import TargetRunner


class Speculator:
    def __init__(self, config: EngineConfig, sampler: Sampler, grammars: Grammars,
                 proposer: Proposer, target: TargetRunner | None = None) -> None:
        """`proposer`: the drafts' source (`config.speculative_algorithm`'s; the engine
        builds it); `target`: the target's runner (whose extend graphs bound a verify step)."""
        self.max_draft = config.speculative_num_draft_tokens
        if config.speculative_algorithm == "draft_model":
            # One draft token per draft forward: at most num_steps of them.
            self.max_draft = min(self.max_draft, config.speculative_num_steps)
        self.proposer = proposer
        self.sampler = sampler
        self.grammars = grammars
        self.stats = SpecStats()
        # (requests, tokens) the target's extend graphs cover; None: no graphs (CPU, or
        # graphs off), where every step runs eagerly and drafting always pays.
        graphs = getattr(target, "graphs", None)
        self.graph_limits = None
        if graphs is not None and graphs.max_extend_tokens:
            self.graph_limits = (graphs.max_extend_bs, graphs.max_extend_tokens)

    def _rooms_in_graphs(self, num_running: int) -> int:
        """Draft tokens per request a verify step may carry and still replay a graph: an
        eager verify step cost 27.7 ms at batch 32 on the H200 against a 5.4 ms decode
        step, more than any acceptance gives back."""
        if self.graph_limits is None:
            return self.max_draft
        max_bs, max_tokens = self.graph_limits
        if num_running > max_bs:
            return 0
        return min(self.max_draft, max_tokens // max(1, num_running) - 1)

    def propose(self, running: list[Request]) -> dict[Request, list[int]]:
        """Drafts for this step's decoding requests that can speculate."""
        reqs, rooms = [], []
        limit = self._rooms_in_graphs(len(running))
        if limit <= 0:
            return {}
        for req in running:
            if req.pending_len != 1:
                continue
            # A step emits at most len(draft) + 1 tokens; more than max_tokens allows is waste.
            room = min(limit, req.params.max_tokens - req.num_output - 1)
            if room > 0:
                reqs.append(req)
                rooms.append(room)
        drafts = {}
        for req, draft in zip(reqs, self.proposer.propose_batch(reqs, rooms) if reqs else []):
            if draft and req.grammar is not None:
                draft = cut_to_grammar(self.grammars, req, draft)
            if draft:
                drafts[req] = draft
        return drafts

    def verify(self, chunks: list[Chunk], logits: torch.Tensor
               ) -> tuple[list[list[int]], list[TokenLogprobs | None]]:
        """Each drafted chunk's kept drafts plus the target's own next token, and their
        logprobs for the chunks that ask for them."""
        raw = logits  # logprobs are reported before penalties and masks, as plain sampling does
        logits = penalized(self.sampler, chunks, logits)
        masks = verify_masks(self.grammars, chunks)
        if masks is not None:
            logits = logits.masked_fill(~masks, float("-inf"))
        qs = [self.proposer.draft_probs(c.req, len(c.draft)) for c in chunks]
        verdicts = verify_chunks(chunks, logits, self.sampler, qs)
        for chunk, tokens in zip(chunks, verdicts):
            accepted = len(tokens) - 1
            self.stats.add(len(chunk.draft), accepted)
            chunk.req.spec_stats.add(len(chunk.draft), accepted)
        return verdicts, token_logprobs(chunks, raw, verdicts)

    def take_verdicts(self, plan: StepPlan, logits: torch.Tensor, processor: OutputProcessor
                      ) -> tuple[StepPlan, torch.Tensor, list[TokenUpdate]]:
        """Take in the verified tokens of the chunks that carried drafts (1 + len(draft)
        logits rows each); the rest of the plan, with its logits rows, goes on as usual."""
        drafted, drafted_rows, rest, rest_rows, t = [], [], [], [], 0
        for chunk in plan.chunks:
            n = 1 + len(chunk.draft)
            if chunk.draft:
                drafted.append(chunk)
                drafted_rows += range(t, t + n)
            else:
                rest.append(chunk)
                rest_rows.append(t)
            t += n
        verdicts, logprobs = self.verify(drafted, logits[drafted_rows])
        updates = [_take_verified(c, tokens, processor, lp)
                   for c, tokens, lp in zip(drafted, verdicts, logprobs)]
        self.proposer.on_verified([c.req for c in drafted])
        return StepPlan(rest), logits[rest_rows], updates

    def release(self, req: Request) -> None:
        """The request's KV was released (finish, abort, retraction): so is the draft's
        state for it (the engine registers this with the scheduler)."""
        self.proposer.release(req)

    def stats_dict(self) -> dict:
        """Engine-level counters: drafted / accepted, and the draft source's own."""
        return {**self.stats.as_dict(), **self.proposer.counters()}

    def reset_stats(self) -> None:
        self.stats = SpecStats()
        self.proposer.reset()


def _take_verified(chunk: Chunk, tokens: list[int], processor: OutputProcessor,
                   logprobs: TokenLogprobs | None = None) -> TokenUpdate:
    """Append the verified tokens one at a time (any may finish the request: EOS, a stop,
    max_tokens) and free the KV of the drafts that were not kept. KV of kept drafts goes
    back to the request only as its tokens are taken, so the request is always in the
    plain decode state (KV for all but its last token)."""
    req = chunk.req
    scheduler = processor.scheduler
    # KV up to and including the request's last token stays; the kept drafts' KV is held.
    held = scheduler.detach_kv(req, chunk.start + 1, keep=len(tokens) - 1)
    gained: list[int] = []
    for i, token in enumerate(tokens):
        req.token_ids.append(token)
        if logprobs is not None:
            req.output_logprobs.append(logprobs[0][i])
            if logprobs[1] is not None:
                req.output_top_logprobs.append(logprobs[1][i])
        # Jump-forward only after the last token: the forced tokens have no KV yet, and
        # the next step computes them as one chunk, as after plain decoding.
        update = processor.advance(req, token, may_jump=i == len(tokens) - 1)
        gained += update.new_tokens
        if update.finished:
            scheduler.free_slots(held[i:])
            return TokenUpdate(req, gained, True)
        if i < len(held):
            scheduler.reattach_kv(req, held[i])
    return TokenUpdate(req, gained, False)
