"""A grammar that starts once the output has written a marker (SamplingParams.grammar_after),
e.g. "</think>": a reasoning model thinks freely, and only its answer is constrained (as
SGLang does with a reasoning parser). Before the marker every token is allowed."""
from __future__ import annotations

import torch

from engine.grammar.base import Matcher


class AfterText(Matcher):
    def __init__(self, inner: Matcher, marker: bytes, token_bytes: list[bytes]) -> None:
        self.inner = inner
        self.marker = marker
        self.token_bytes = token_bytes  # token id -> its bytes
        self.free: list[int] = []  # tokens accepted before the grammar started
        self.constrained = 0  # tokens the inner grammar accepted
        self.started = False

    def accept(self, token: int) -> bool:
        if self.started:
            if not self.inner.accept(token):
                return False
            self.constrained += 1
            return True
        self.free.append(token)
        # Bytes after the marker inside the same token are not checked: where the marker
        # is a token of its own (Qwen3, DeepSeek-R1) there are none.
        self.started = self._tail_has_marker()
        return True

    def _tail_has_marker(self) -> bool:
        """Does the marker end in the last free token? (Bytes enough to hold it, no more.)"""
        need = len(self.marker) - 1 + len(self.token_bytes[self.free[-1]])
        tail, k = b"", len(self.free)
        while k > 0 and len(tail) < need:
            k -= 1
            tail = self.token_bytes[self.free[k]] + tail
        return self.marker in tail

    def rollback(self, num_tokens: int) -> None:
        undo = min(num_tokens, self.constrained)
        if undo:
            self.inner.rollback(undo)
            self.constrained -= undo
        if num_tokens > undo:  # back into the free part: the marker may be undone too
            del self.free[len(self.free) - (num_tokens - undo):]
            self.started = bool(self.free) and self._tail_has_marker()

    def jump_forward_tokens(self) -> list[int]:
        return self.inner.jump_forward_tokens() if self.started else []

    @property
    def is_terminated(self) -> bool:
        return self.started and self.inner.is_terminated

    @classmethod
    def fill_bitmask(cls, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Rows still before the marker stay all-allowed; the others get their grammar's."""
        by_type: dict[type, tuple[list[Matcher], list[int]]] = {}
        for m, row in zip(matchers, rows):
            if m.started:  # type: ignore[attr-defined]
                inner = m.inner  # type: ignore[attr-defined]
                group = by_type.setdefault(type(inner), ([], []))
                group[0].append(inner)
                group[1].append(row)
        for inner_cls, (inners, inner_rows) in by_type.items():
            inner_cls.fill_bitmask(inners, bitmask, inner_rows)
