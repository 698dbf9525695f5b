"""N-gram drafts ("prompt lookup"): when the request's last tokens occurred earlier in its
own prompt or output, propose the tokens that followed them then. No second model; wins
on copy-heavy work (editing code, quoting, repeating a text with fixes)."""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from engine.core.request import Request
from engine.speculative.proposer import Proposer


@dataclass
class NgramIndex:
    """Every n-gram of a token list (min_n <= n <= max_n) that ends before `upto`, mapped
    to the position just after its latest occurrence. Built incrementally: a request's
    tokens only grow while it speculates, so each token is indexed once."""

    upto: int = 0
    table: dict[tuple[int, ...], int] = field(default_factory=dict)

    def extend(self, tokens: list[int], end: int, min_n: int, max_n: int) -> None:
        for stop in range(self.upto + 1, end + 1):  # n-grams tokens[stop-n:stop]
            for n in range(min_n, min(max_n, stop) + 1):
                self.table[tuple(tokens[stop - n:stop])] = stop
        self.upto = max(self.upto, end)


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        # Per request, dropped with it (requests are hashed by identity).
        self._indexes: weakref.WeakKeyDictionary[Request, NgramIndex] = weakref.WeakKeyDictionary()

    def propose(self, req: Request, max_len: int) -> list[int]:
        """Up to `max_len` tokens that followed the longest suffix of the request's tokens
        (max_n down to min_n) at its latest earlier occurrence; [] when none occurred."""
        tokens = req.token_ids
        index = self._indexes.setdefault(req, NgramIndex())
        # Index n-grams that end before the last token: the suffix itself must not match.
        index.extend(tokens, len(tokens) - 1, self.min_n, self.max_n)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            after = index.table.get(tuple(tokens[-n:]))
            if after is not None:
                return tokens[after:after + max_len]
        return []
