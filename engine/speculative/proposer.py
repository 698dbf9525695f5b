"""What a source of drafts offers the Speculator (engine/speculative/speculator.py): the
n-gram lookup (ngram.py) and the draft model (draft_model.py) share this interface."""
from __future__ import annotations

import torch

from engine.core.request import Request


class Proposer:
    """Drafts for a batch of decoding requests, and the hooks around their verification.
    Deterministic sources (n-gram) only implement `propose`; a model that samples its
    drafts also reports the distribution each was drawn from (`draft_probs`), which
    rejection sampling needs to keep the output distribution the target's."""

    def propose_batch(self, reqs: list[Request], rooms: list[int]) -> list[list[int]]:
        """Up to rooms[i] draft tokens after reqs[i]'s last token (may be [])."""
        return [self.propose(req, room) for req, room in zip(reqs, rooms)]

    def propose(self, req: Request, max_len: int) -> list[int]:
        raise NotImplementedError

    def draft_probs(self, req: Request, n: int) -> torch.Tensor | None:
        """[n, vocab] probabilities the request's first n drafts of this step were drawn
        from; None for deterministic drafts (one-hot)."""
        return None

    def on_verified(self, reqs: list[Request]) -> None:
        """The target judged these requests' drafts and took in the kept tokens."""

    def release(self, req: Request) -> None:
        """The request stopped running (finished, aborted, retracted): drop its state."""

    def counters(self) -> dict:
        """Engine-level counters of the source, merged into `engine.stats()`."""
        return {}

    def flush_cache(self) -> None:
        """Drop cached prefixes the source keeps (the engine's cache was flushed)."""

    def reset(self) -> None:
        """Forget counters and cached prefixes (after the warm-up)."""
        self.flush_cache()
