"""What one step computes (`StepPlan`): a chunk of new tokens for each request in it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core.request import Request


@dataclass
class Chunk:
    """`num_tokens` new tokens of `req`, starting at sequence position `start`. A decode
    chunk may carry speculative `draft` tokens after the request's last token: they are
    fed too (counted in `num_tokens`) and every position's logits come back to verify them.
    `row_from`: the request's device row holds its slots up to here; the step writes the
    rest (set by the scheduler when it hands out the plan)."""

    req: Request
    start: int
    num_tokens: int
    draft: list[int] = field(default_factory=list)
    row_from: int = 0

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the request's tokens, so its last logits are sampled."""
        return self.start + self.num_tokens - len(self.draft) == self.req.num_tokens


@dataclass
class StepPlan:
    chunks: list[Chunk]

    @property
    def is_decode(self) -> bool:
        return all(c.num_tokens == 1 for c in self.chunks)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)
