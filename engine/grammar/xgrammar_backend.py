"""The xgrammar backend (the default): compiled grammars, matchers, batched bitmask fills."""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from engine.grammar.base import (
    ITEM_SEPARATOR, KEY_SEPARATOR, CompiledGrammar, GrammarBackend, GrammarSpec, Matcher,
    clean_message,
)


class XGrammarMatcher(Matcher):
    def __init__(self, matcher: Any, and_mask: torch.Tensor | None) -> None:
        self.m = matcher
        self.and_mask = and_mask  # packed tokens always forbidden on top of the grammar

    def accept(self, token: int) -> bool:
        return self.m.accept_token(token)

    def rollback(self, num_tokens: int) -> None:
        self.m.rollback(num_tokens)

    def jump_forward_tokens(self) -> list[int]:
        return self.m.find_jump_forward_tokens()

    @property
    def is_terminated(self) -> bool:
        return self.m.is_terminated()

    # Shared xgrammar BatchGrammarMatchers: one filling rows in the caller's thread, one
    # with a thread pool. The pool only pays off for big batches of big vocabularies on a
    # machine with cores to spare: its hand-off costs ~0.1 ms, and where cores are few it
    # competes with torch's threads (on 2 cores a 64-row fill of a 768-token vocabulary took
    # ~1-2 ms pooled in the step loop, ~0.05 ms in the calling thread).
    _batch: Any = None
    _batch_threaded: Any = None
    _THREADED_MIN_WORK = 1 << 21  # rows x vocab size from which the pool is used
    _THREADS = min(8, os.cpu_count() or 1)

    @classmethod
    def fill_bitmask(cls, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        import xgrammar as xgr

        handles = [m.m for m in matchers]  # type: ignore[attr-defined]
        if len(handles) == 1:
            handles[0].fill_next_token_bitmask(bitmask, rows[0])
        elif cls._THREADS >= 4 and len(handles) * bitmask.shape[1] * 32 >= cls._THREADED_MIN_WORK:
            if cls._batch_threaded is None:
                cls._batch_threaded = xgr.BatchGrammarMatcher(max_threads=cls._THREADS)
            cls._batch_threaded.batch_fill_next_token_bitmask(handles, bitmask, rows)
        else:
            if cls._batch is None:
                cls._batch = xgr.BatchGrammarMatcher(max_threads=1)
            cls._batch.batch_fill_next_token_bitmask(handles, bitmask, rows)
        by_mask: dict[int, tuple[torch.Tensor, list[int]]] = {}
        for m, row in zip(matchers, rows):
            and_mask = m.and_mask  # type: ignore[attr-defined]
            if and_mask is not None:
                by_mask.setdefault(id(and_mask), (and_mask, []))[1].append(row)
        for and_mask, masked in by_mask.values():  # one op per mask, not one per row
            if len(masked) == 1:
                bitmask[masked[0]] &= and_mask
            else:
                bitmask[torch.tensor(masked)] &= and_mask


class _XGrammarCompiled(CompiledGrammar):
    def __init__(self, compiled: Any, and_mask: torch.Tensor | None) -> None:
        self.compiled = compiled
        self.and_mask = and_mask

    def new_matcher(self) -> Matcher:
        import xgrammar as xgr

        return XGrammarMatcher(xgr.GrammarMatcher(self.compiled), self.and_mask)


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, info: Any) -> None:
        import xgrammar as xgr

        self.compiler = xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1),
                                            cache_enabled=False)  # we cache ourselves
        # xgrammar 0.2.9 lets raw control characters into JSON strings that have a
        # maxLength (invalid JSON). Compact JSON never contains a raw byte < 0x20, so for
        # JSON grammars we also forbid every token holding one.
        clean = [not any(b < 0x20 for b in t) for t in info.decoded_vocab]
        self.no_control = _pack(clean)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        c = self.compiler
        try:
            if spec.kind == "json":
                out = c.compile_json_schema(spec.text, any_whitespace=False,
                                            separators=(ITEM_SEPARATOR, KEY_SEPARATOR))
            elif spec.kind == "json_object":
                out = c.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                            separators=(ITEM_SEPARATOR, KEY_SEPARATOR))
            elif spec.kind == "regex":
                out = c.compile_regex(spec.text)
            else:
                out = c.compile_grammar(spec.text)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(clean_message(e)) from None
        return _XGrammarCompiled(out, self.no_control if spec.kind.startswith("json") else None)


def _pack(allowed: list[bool]) -> torch.Tensor:
    """Bools -> packed int32 words in xgrammar's layout (bit j of word w = token 32w + j)."""
    padded = np.zeros(-(-len(allowed) // 32) * 32, dtype=bool)
    padded[:len(allowed)] = allowed
    return torch.from_numpy(np.packbits(padded, bitorder="little").view("<i4").copy())


def xgrammar_tokenizer_info(hf_tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> Any:
    """xgrammar's view of the vocabulary, padded to the logits' width.

    xgrammar takes added special tokens such as `<s>` or `<pad>` for the literal text
    "<s>" and would let them into a JSON string, yet the detokenizer drops them. Giving
    them empty text makes xgrammar treat them as special, i.e. never allowed.
    """
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=stop_ids or None)
    special = set(hf_tokenizer.all_special_ids)
    special |= {i for i, t in hf_tokenizer.added_tokens_decoder.items() if t.special}
    vocab = [b"" if i in special and i not in stop_ids else text
             for i, text in enumerate(info.decoded_vocab)]
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=info.stop_token_ids,
                             add_prefix_space=info.add_prefix_space)
