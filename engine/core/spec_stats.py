"""Counters of speculative decoding, per request and per engine."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecStats:
    """`steps`: verify steps that carried a draft; `drafted`: draft tokens verified;
    `accepted`: draft tokens the target accepted. Each such step also emits one token of
    the target's own (the correction or bonus token), so a step yields accepted + 1."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    def add(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step (1.0 = no better than plain decoding)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict:
        return {"spec_steps": self.steps, "spec_drafted_tokens": self.drafted,
                "spec_accepted_tokens": self.accepted,
                "spec_acceptance_rate": self.acceptance_rate,
                "spec_mean_acceptance_length": self.mean_acceptance_length}
