"""The engine's speculative-decoding side: which requests draft, their drafts, and the
verdict on them. The engine feeds the drafts to the target after each request's last
token (`Scheduler.schedule(drafts)`: KV slots for them when memory allows), then takes in
the verified tokens and frees the KV of the rejected drafts (`Engine._take_verified`)."""
from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.request import Request
from engine.sampler import Sampler
from engine.scheduler import Chunk
from engine.speculative.ngram import NgramProposer
from engine.speculative.stats import SpecStats
from engine.speculative.verify import verify_chunks


def can_speculate(req: Request) -> bool:
    """Requests whose next tokens cannot be judged from the target's logits alone decode
    plainly: structured output (a mask per position, from the grammar state after each
    draft), penalties (they depend on the tokens before each position) and logprobs
    (reported per sampled token, not per verified one)."""
    p = req.params
    return not (p.has_constraint or p.has_penalties or p.logprobs or p.top_logprobs)


class Speculator:
    def __init__(self, config: EngineConfig, sampler: Sampler) -> None:
        if config.speculative_algorithm != "ngram":
            raise NotImplementedError(
                f"speculative_algorithm={config.speculative_algorithm!r} is not implemented "
                "yet (only 'ngram')")
        self.max_draft = config.speculative_num_draft_tokens
        self.proposer = NgramProposer(config.speculative_ngram_min_match,
                                      config.speculative_ngram_max_match)
        self.sampler = sampler
        self.stats = SpecStats()

    def propose(self, running: list[Request]) -> dict[Request, list[int]]:
        """Drafts for this step's decoding requests that can speculate."""
        drafts = {}
        for req in running:
            if req.pending_len != 1 or not can_speculate(req):
                continue
            # A step emits at most len(draft) + 1 tokens; more than max_tokens allows is waste.
            room = min(self.max_draft, req.params.max_tokens - req.num_output - 1)
            draft = self.proposer.propose(req, room) if room > 0 else []
            if draft:
                drafts[req] = draft
        return drafts

    def verify(self, chunks: list[Chunk], logits: torch.Tensor) -> list[list[int]]:
        """Each drafted chunk's kept drafts plus the target's own next token."""
        verdicts = verify_chunks(chunks, logits, self.sampler)
        for chunk, tokens in zip(chunks, verdicts):
            accepted = len(tokens) - 1
            self.stats.add(len(chunk.draft), accepted)
            chunk.req.spec_stats.add(len(chunk.draft), accepted)
        return verdicts
