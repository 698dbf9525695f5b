"""Prompt logprobs (`SamplingParams.prompt_logprobs_start`): which token rows of a step
score prompt tokens, and their values once the step has run."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request
from engine.step_plan import StepPlan

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

    def logprobs(self, logits: torch.Tensor) -> list[PromptLogprob]:
        """`logits`: one row per target, in order."""
        logprobs = torch.log_softmax(logits, dim=-1)
        index = torch.tensor(self.tokens, device=logprobs.device).unsqueeze(1)
        values = logprobs.gather(1, index).squeeze(1).tolist()
        return [(req, pos, v, top) for (req, pos), v, top
                in zip(self.owners, values, self._top(logprobs))]

    def _top(self, logprobs: torch.Tensor) -> list[list | None]:
        """Each row's top-k (token, logprob), k = its request's top_logprobs (0: None)."""
        ks = [req.params.top_logprobs for req, _ in self.owners]
        if not any(ks):
            return [None] * len(ks)
        values, ids = logprobs.topk(max(ks), dim=-1)
        values, ids = values.tolist(), ids.tolist()
        return [list(zip(ids[i][:k], values[i][:k])) if k else None for i, k in enumerate(ks)]
