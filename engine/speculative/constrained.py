"""Structured output under speculation: drafts cut where the grammar would refuse them,
and a grammar mask for every verified position.

A constrained request's draft d_1..d_k is walked through its matcher: the draft stops
before the first token the grammar refuses, before a token that would end the grammar
(the request then finishes on it, and plain decoding samples that last token under its
mask), and before a token after which jump-forward would append forced text (plain
decoding jumps there instead of decoding the next position; the target's own token at
that position, the step's last, jumps as plain decoding's does). Verification masks row i
(the logits after d_1..d_i) with the grammar state after those drafts, so greedy requests
keep exactly what masked plain decoding would pick and sampled requests sample from the
masked target distribution. The matcher is rolled back after each walk: the verified
tokens advance it later, one at a time, as plain decoding's tokens do."""
from __future__ import annotations

import torch

from engine.grammar import Grammars
from engine.grammar.base import Matcher
from engine.core.request import Request
from engine.core.step_plan import Chunk


def matcher_or_none(grammars: Grammars, req: Request) -> Matcher | None:
    """The request's matcher, or None when its constraint failed to compile (the plain
    path aborts it)."""
    try:
        return grammars.matcher_of(req)
    except ValueError:
        return None


def cut_to_grammar(grammars: Grammars, req: Request, draft: list[int]) -> list[int]:
    """The longest prefix of `draft` the request's grammar accepts without ending or
    jumping forward."""
    matcher = matcher_or_none(grammars, req)
    if matcher is None:
        return []
    accepted = kept = 0
    for token in draft:
        if not matcher.accept(token):
            break
        accepted += 1
        if matcher.is_terminated or grammars.would_jump(req, token):
            break  # leave that token to the step's last position, as plain decoding has it
        kept += 1
    matcher.rollback(accepted)
    return draft[:kept]


def verify_masks(grammars: Grammars, chunks: list[Chunk]) -> torch.Tensor | None:
    """Bool [sum(1 + len(draft)), vocab] of allowed tokens at every verified position of
    `chunks` (rows of unconstrained requests allow everything); None when no chunk is
    constrained. Drafts must already be cut by `cut_to_grammar`."""
    if not any(c.req.grammar is not None for c in chunks):
        return None
    rows = sum(1 + len(c.draft) for c in chunks)
    words = (grammars.vocab_size + 31) // 32
    bitmask = torch.full((rows, words), -1, dtype=torch.int32)  # -1: all allowed
    row = 0
    for chunk in chunks:
        matcher = None if chunk.req.grammar is None else matcher_or_none(grammars, chunk.req)
        if matcher is not None:
            _fill_rows(matcher, chunk.draft, bitmask, row)
        row += 1 + len(chunk.draft)
    return grammars.unpack(bitmask.to(grammars.device))


def _fill_rows(matcher: Matcher, draft: list[int], bitmask: torch.Tensor, first_row: int) -> None:
    """Rows first_row .. first_row + len(draft): the allowed tokens after 0..len(draft) drafts."""
    accepted = 0
    for i in range(len(draft) + 1):
        type(matcher).fill_bitmask([matcher], bitmask, [first_row + i])
        if i < len(draft):
            if not matcher.accept(draft[i]):
                raise AssertionError("a draft cut by cut_to_grammar must be accepted")
            accepted += 1
    matcher.rollback(accepted)
