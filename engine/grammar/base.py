"""What every grammar backend provides: a canonical constraint (`GrammarSpec`, the cache
key), a compiled grammar, and per-request matchers that fill the batch's packed bitmask."""
from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from engine.core.sampling_params import SamplingParams

# JSON comes out compact: models need not (and a random model would never stop to) choose
# whitespace, and more of the text is forced, which jump-forward skips.
ITEM_SEPARATOR, KEY_SEPARATOR = ", ", ": "


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint in canonical form: the cache key of its compiled grammar."""

    kind: str  # "json" | "json_object" | "regex" | "ebnf"
    text: str  # the schema as JSON (key order kept: it is the output's), or the source

    @staticmethod
    def of(params: SamplingParams) -> GrammarSpec | None:
        if params.json_schema is not None:
            return GrammarSpec("json", json.dumps(params.json_schema, separators=(",", ":")))
        if params.json_object:
            return GrammarSpec("json_object", "")
        if params.regex is not None:
            return GrammarSpec("regex", params.regex)
        if params.ebnf is not None:
            return GrammarSpec("ebnf", params.ebnf)
        return None


class Matcher(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def accept(self, token: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar forbids it."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    @abstractmethod
    def jump_forward_tokens(self) -> list[int]:
        """Tokens spelling the text the grammar forces next (not yet accepted). The last
        token is left out when a longer token could start with it."""

    @property
    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar ended with a stop token: nothing more may follow."""

    @classmethod
    @abstractmethod
    def fill_bitmask(cls, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Write each matcher's allowed next tokens into its row of the packed CPU bitmask."""


class CompiledGrammar(ABC):
    @abstractmethod
    def new_matcher(self) -> Matcher: ...


class GrammarBackend(ABC):
    name: str

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile against the model's vocabulary; ValueError with the compiler's message."""


def clean_message(error: Exception) -> str:
    # xgrammar prefixes C++ errors with "[time] file.cc:line: ".
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(error)).strip()
