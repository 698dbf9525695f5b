"""Prompt logprobs (`SamplingParams.prompt_logprobs_start`): which token rows of a step
score prompt tokens, and their values once the step has run (as tensors first, so the
overlap scheduler can bring them back with the step's tokens)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.request import Request
from engine.executor.staging import to_device, to_host
from engine.core.step_plan import StepPlan

# (request, prompt position, logprob, top: the position's top_logprobs (token, logprob) or None)
PromptLogprob = tuple[Request, int, float, list | None]


@dataclass
class PromptTargets:
    """Token rows of the step whose logits score a prompt token: the row, the token it
    scores, and the (request, position) of that token."""

    rows: list[int]
    tokens: list[int]
    owners: list[tuple[Request, int]]

    @classmethod
    def of(cls, plan: StepPlan) -> PromptTargets:
        rows, tokens, owners = [], [], []
        t = 0
        for chunk in plan.chunks:
            req = chunk.req
            # (The attribute test first: this runs every step, over every decoding request.)
            first = req.prompt_logprobs_from if req.prompt_logprobs is not None else None
            if first is not None:
                # Logits at position p score the prompt token at p + 1.
                for p in range(max(chunk.start, first - 1),
                               min(chunk.start + chunk.num_tokens, req.num_prompt - 1)):
                    rows.append(t + p - chunk.start)
                    tokens.append(req.token_ids[p + 1])
                    owners.append((req, p + 1))
            t += chunk.num_tokens
        return cls(rows, tokens, owners)

    def scores(self, logits: torch.Tensor) -> PromptScores:
        """`logits`: one row per target, in order. Left on their device (no host sync)."""
        logprobs = torch.log_softmax(logits, dim=-1)
        index = to_device(self.tokens, torch.long, logprobs.device).unsqueeze(1)
        values = logprobs.gather(1, index).squeeze(1)
        ks = [req.params.top_logprobs for req, _ in self.owners]
        top_values = top_ids = None
        if any(ks):
            top_values, top_ids = logprobs.topk(max(ks), dim=-1)
        return PromptScores(self.owners, ks, values, top_values, top_ids)


@dataclass
class PromptScores:
    """A step's prompt logprobs as tensors: each target's value, and the top `ks[i]` of
    its row (tensors absent when no target asks); `resolve` turns them into rows."""

    owners: list[tuple[Request, int]]
    ks: list[int]
    values: torch.Tensor | None = None
    top_values: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None

    def to_host(self) -> PromptScores:
        """Non-blocking copies into pinned memory (there once the stream passes them)."""
        return PromptScores(self.owners, self.ks, to_host(self.values), to_host(self.top_values),
                            to_host(self.top_ids))

    def resolve(self) -> list[PromptLogprob]:
        """(request, position, logprob, top) per target (waits for the values)."""
        if not self.owners:
            return []
        values = self.values.tolist()
        tops: list[list | None] = [None] * len(self.ks)
        if self.top_values is not None:
            top_values, top_ids = self.top_values.tolist(), self.top_ids.tolist()
            tops = [list(zip(top_ids[i][:k], top_values[i][:k])) if k else None
                    for i, k in enumerate(self.ks)]
        return [(req, pos, v, top) for (req, pos), v, top in zip(self.owners, values, tops)]
