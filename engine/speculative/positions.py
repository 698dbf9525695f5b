"""What the target's logits at each verified position are judged and reported by, when a
request's sampling depends on the tokens before it: penalties, logit_bias and min_tokens
count the drafts ahead of the position (as plain decoding would have, had it sampled them),
and logprobs are read from the raw logits at the position that produced each kept token
(before penalties and masks, as plain sampling reports them)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.executor.sampler import Sampler
from engine.core.sampling_params import SamplingParams
from engine.core.step_plan import Chunk


@dataclass
class _WithDrafts:
    """A request as it would stand after the first drafts of its chunk: what penalties read
    at a verified position (the drafts before it count as generated tokens)."""

    params: SamplingParams
    token_ids: list[int]
    output_ids: list[int]


def penalized(sampler: Sampler, chunks: list[Chunk], logits: torch.Tensor) -> torch.Tensor:
    """`logits` (1 + len(draft) rows per chunk) with the penalties, logit_bias and min_tokens
    of each chunk's request applied at every position, counting the drafts before it: what
    plain decoding would apply had it sampled those drafts."""
    if not any(c.req.params.has_penalties for c in chunks):
        return logits
    rows, views, t = [], [], 0
    for c in chunks:
        req = c.req
        if req.params.has_penalties:
            for i in range(1 + len(c.draft)):
                rows.append(t + i)
                views.append(_WithDrafts(req.params, req.token_ids + c.draft[:i],
                                         req.output_ids + c.draft[:i]))
        t += 1 + len(c.draft)
    logits = logits.clone()
    logits[rows] = sampler.apply_penalties(logits[rows], views)
    return logits


TokenLogprobs = tuple[list[float], list | None]  # per token: its logprob; its top logprobs


def token_logprobs(chunks: list[Chunk], logits: torch.Tensor, verdicts: list[list[int]]
                   ) -> list[TokenLogprobs | None]:
    """For chunks whose request wants logprobs: each verified token's log-probability (and
    top alternatives) under the target's raw logits at the position that produced it."""
    out: list[TokenLogprobs | None] = []
    t = 0
    for chunk, tokens in zip(chunks, verdicts):
        p = chunk.req.params
        if p.logprobs or p.top_logprobs:
            rows = torch.log_softmax(logits[t:t + len(tokens)], dim=-1)
            ids = torch.tensor(tokens, device=rows.device)
            out.append(Sampler.gather_logprobs(rows, ids, [p] * len(tokens)))
        else:
            out.append(None)
        t += 1 + len(chunk.draft)
    return out
