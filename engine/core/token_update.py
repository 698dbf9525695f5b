"""TokenUpdate: what one step did for one request, as the step loops hand it to the servers
(engine/executor/output_processor.py makes them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core.request import Request


@dataclass
class TokenUpdate:
    """One request's progress in one step: the tokens it gained (0 or 1; more with
    jump-forward or speculative decoding)."""

    req: Request
    new_tokens: list[int]
    finished: bool
