"""The llguidance backend: the fallback for JSON schemas and regexes xgrammar rejects."""
from __future__ import annotations

import json
from typing import Any

import torch

from engine.grammar.base import (
    ITEM_SEPARATOR, KEY_SEPARATOR, CompiledGrammar, GrammarBackend, GrammarSpec, Matcher,
)


class LLGuidanceMatcher(Matcher):
    def __init__(self, matcher: Any, stop_ids: frozenset[int]) -> None:
        self.m = matcher
        self.stop_ids = stop_ids
        self.terminated = False

    def accept(self, token: int) -> bool:
        # Check first: a refused consume_token would leave the matcher in its error state.
        if token in self.stop_ids:
            if not self.m.is_accepting():
                return False
        elif self.m.validate_tokens([token]) != 1:
            return False
        self.m.consume_token(token)
        # llguidance reports "stopped" before and after the stop token; track it here.
        self.terminated = token in self.stop_ids
        return True

    def rollback(self, num_tokens: int) -> None:
        self.m.rollback(num_tokens)
        self.terminated = False

    def jump_forward_tokens(self) -> list[int]:
        return self.m.compute_ff_tokens()

    @property
    def is_terminated(self) -> bool:
        return self.terminated

    @classmethod
    def fill_bitmask(cls, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        from llguidance.torch import fill_next_token_bitmask

        for m, row in zip(matchers, rows):
            fill_next_token_bitmask(m.m, bitmask, row)  # type: ignore[attr-defined]


class _LLGuidanceCompiled(CompiledGrammar):
    def __init__(self, template: Any, stop_ids: frozenset[int]) -> None:
        self.template = template  # a matcher at the start; copying it is cheaper than building
        self.stop_ids = stop_ids

    def new_matcher(self) -> Matcher:
        return LLGuidanceMatcher(self.template.deep_copy(), self.stop_ids)


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> None:
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                      eos_token=stop_ids)
        self.stop_ids = frozenset(stop_ids)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        from llguidance import LLMatcher

        try:
            grammar = self._grammar(spec)
        except (ValueError, TypeError) as e:
            raise ValueError(str(e)) from None
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error().strip())
        return _LLGuidanceCompiled(matcher, self.stop_ids)

    @staticmethod
    def _grammar(spec: GrammarSpec) -> str:
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark

        options = {"whitespace_flexible": False, "item_separator": ITEM_SEPARATOR,
                   "key_separator": KEY_SEPARATOR}
        if spec.kind == "json":
            schema = _closed_objects(json.loads(spec.text))
            return LLMatcher.grammar_from_json_schema(schema, overrides=options)
        if spec.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options)
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.text)
        return LLMatcher.grammar_from_lark(any_to_lark(spec.text))  # EBNF (GBNF) or Lark


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else")


def _closed_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` wherever an object lists its
    properties and says nothing about others: xgrammar's default (and OpenAI's strict
    mode), so both backends generate the same kind of objects rather than llguidance
    inventing extra keys. Outputs stay valid under the original schema."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed_objects(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = _closed_objects(out[key])
    open_keys = ("additionalProperties", "unevaluatedProperties", "patternProperties")
    if "properties" in out and not any(k in out for k in open_keys):
        out["additionalProperties"] = False
    return out
