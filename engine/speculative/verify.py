"""Verification: which draft tokens the target keeps, and the one token it adds.

Given the target's logits at the k + 1 positions of [last token, d_1 .. d_k]:
- greedy rows keep the longest run of drafts equal to the target's argmax, then add the
  argmax at the first mismatch (or after the last draft), so the output is token for token
  what plain decoding gives;
- sampled rows use rejection sampling: d_i is kept with probability min(1, p(d_i) / q(d_i)),
  and the first rejected position draws from max(0, p - q), renormalised. The output then
  follows the target's distribution p exactly, whatever the draft distribution q. N-gram
  drafts are deterministic (q is one-hot on d_i): keep d_i with probability p(d_i), else
  draw from p with d_i's mass removed.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from engine.kernels.argmax import argmax_rows
from engine.executor.sampler import Sampler
from engine.core.step_plan import Chunk


def verify_greedy(target_ids: list[int], draft: list[int]) -> list[int]:
    """`target_ids`: the target's argmax at each of the len(draft) + 1 positions."""
    a = 0
    while a < len(draft) and draft[a] == target_ids[a]:
        a += 1
    return draft[:a] + [target_ids[a]]


def rejection_sample(p: torch.Tensor, draft: list[int], u: torch.Tensor,
                     draw: Callable[[torch.Tensor], int], q: torch.Tensor | None = None) -> list[int]:
    """p: [k+1, V] target probabilities; u: [k] uniforms; q: [k, V] draft probabilities
    (None: deterministic drafts, one-hot). `draw(weights)` samples an index from a
    non-negative [V] vector. Returns the kept drafts and one new token."""
    k = len(draft)
    d = torch.tensor(draft, device=p.device)
    pos = torch.arange(k, device=p.device)
    p_d = p[pos, d]
    q_d = torch.ones_like(p_d) if q is None else q[pos, d]
    rejected = (u * q_d >= p_d).nonzero()  # u < p/q, written without dividing by q
    if rejected.numel() == 0:
        return draft + [draw(p[k])]
    a = int(rejected[0, 0])
    if q is None:
        residual = p[a].clone()
        residual[draft[a]] = 0.0
    else:
        residual = (p[a] - q[a]).clamp_(min=0.0)
    if float(residual.sum()) <= 0.0:  # p == q up to rounding: rejection had ~0 chance
        residual = p[a]
    return draft[:a] + [draw(residual)]


def verify_chunks(chunks: list[Chunk], logits: torch.Tensor, sampler: Sampler,
                  qs: list[torch.Tensor | None] | None = None) -> list[list[int]]:
    """The tokens each drafted chunk gains: `logits` holds 1 + len(draft) rows per chunk,
    back to back. Greedy chunks are judged in one argmax for all of them. `qs[i]`: the
    [len(draft), V] distribution chunk i's drafts were drawn from (None: deterministic)."""
    starts, t = [], 0
    for c in chunks:
        starts.append(t)
        t += 1 + len(c.draft)
    out: list[list[int] | None] = [None] * len(chunks)
    greedy = [i for i, c in enumerate(chunks) if c.req.params.is_greedy]
    if greedy:
        rows = [r for i in greedy for r in range(starts[i], starts[i] + 1 + len(chunks[i].draft))]
        argmax = argmax_rows(logits[rows]).tolist()
        at = 0
        for i in greedy:
            n = 1 + len(chunks[i].draft)
            out[i] = verify_greedy(argmax[at:at + n], chunks[i].draft)
            at += n
    for i, c in enumerate(chunks):
        if out[i] is None:
            n = 1 + len(c.draft)
            p = sampler.probs(logits[starts[i]:starts[i] + n], [c.req.params] * n)
            p = p / p.sum(dim=-1, keepdim=True)  # top-k/p filters leave rows unnormalised
            out[i] = rejection_sample(p, c.draft, sampler.uniform(c.req, len(c.draft)),
                                      lambda w, req=c.req: int(sampler.draw(w[None], [req])[0]),
                                      qs[i] if qs else None)
    return out
