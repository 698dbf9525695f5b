"""Structured output: regex, JSON schema and EBNF constraints as per-token masks.

A constraint (`SamplingParams.regex / json_schema / ebnf / json_object`) is compiled once
against the model's vocabulary into a grammar; each constrained request gets its own
matcher of that grammar, which lives on the `Request` and advances only when a token is
appended (so a retracted request resumes with the right state). Each step, the matchers of
the batch fill a packed bitmask (1 bit per token), which becomes a bool mask on the logits'
device before sampling.

Backends: xgrammar by default; llguidance for JSON schemas and regexes that xgrammar
rejects (or as the only backend). Compiles run on a small thread pool and are cached by
constraint, so the same schema compiles once and a slow compile never runs on the step loop.

Jump-forward (SGLang's compressed FSM): when the grammar forces the next characters (the
`"name": "` between two JSON values), the engine appends their tokens at once instead of
decoding them one by one; the next step computes their KV in one chunk.
"""
from __future__ import annotations

import bisect
import json
import logging
import os
import re
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.request import Request
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

BACKENDS = ("xgrammar", "llguidance", "none")
_CACHE_SIZE = 512  # compiled grammars (and compile errors) kept, least recently used out
# JSON comes out compact: models need not (and a random model would never stop to) choose
# whitespace, and more of the text is forced, which jump-forward skips.
_ITEM_SEPARATOR, _KEY_SEPARATOR = ", ", ": "
# The name each constraint has in the API, for error messages.
_FIELD = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "ebnf": "ebnf"}


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


# -- backend interface ------------------------------------------------------------------


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


def _clean_message(error: Exception) -> str:
    # xgrammar prefixes C++ errors with "[time] file.cc:line: ".
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(error)).strip()


# -- xgrammar -------------------------------------------------------------------------


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
                                            separators=(_ITEM_SEPARATOR, _KEY_SEPARATOR))
            elif spec.kind == "json_object":
                out = c.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                            separators=(_ITEM_SEPARATOR, _KEY_SEPARATOR))
            elif spec.kind == "regex":
                out = c.compile_regex(spec.text)
            else:
                out = c.compile_grammar(spec.text)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(_clean_message(e)) from None
        return _XGrammarCompiled(out, self.no_control if spec.kind.startswith("json") else None)


def _pack(allowed: list[bool]) -> torch.Tensor:
    """Bools -> packed int32 words in xgrammar's layout (bit j of word w = token 32w + j)."""
    padded = np.zeros(-(-len(allowed) // 32) * 32, dtype=bool)
    padded[:len(allowed)] = allowed
    return torch.from_numpy(np.packbits(padded, bitorder="little").view("<i4").copy())


def _xgrammar_tokenizer_info(hf_tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> Any:
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


# -- llguidance -----------------------------------------------------------------------


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

        options = {"whitespace_flexible": False, "item_separator": _ITEM_SEPARATOR,
                   "key_separator": _KEY_SEPARATOR}
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


# -- the engine's entry point -----------------------------------------------------------


class Grammars:
    """Compiles constraints (pooled, cached), builds batch masks, finds jump-forward tokens.

    Backends are built on first use, so engines without constrained requests pay nothing.
    """

    def __init__(self, backend: str, hf_tokenizer: Any, vocab_size: int, stop_ids: set[int],
                 device: torch.device, jump_forward: bool = True, workers: int = 2) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"grammar_backend must be one of {BACKENDS}, got {backend!r}")
        self.backend_name = backend
        self.hf = hf_tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self.device = device
        self.enable_jump_forward = jump_forward
        self._backends: dict[str, GrammarBackend] = {}
        self._backend_lock = threading.Lock()
        self._info: Any = None  # xgrammar TokenizerInfo, built on first need
        self._token_bytes: list[bytes] | None = None
        self._sorted_tokens: list[bytes] = []
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar")
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)
        self.num_compiles = 0

    # -- compiling ------------------------------------------------------------------------

    def submit(self, params: SamplingParams) -> Future:
        """Future of the request's CompiledGrammar; compiles at most once per constraint."""
        spec = GrammarSpec.of(params)
        assert spec is not None, "submit() needs a constrained request"
        with self._cache_lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def check(self, params: SamplingParams) -> None:
        """Compile now (or wait for the running compile); ValueError if it fails."""
        if params.has_constraint:
            self.submit(params).result()

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        if self.backend_name == "none":
            raise ValueError("structured output (regex, json_schema, ebnf, response_format) is "
                             "disabled on this server (grammar_backend='none')")
        self.num_compiles += 1
        primary = self._backend(self.backend_name)
        try:
            return primary.compile(spec)
        except ValueError as e:
            error = f"invalid {_FIELD[spec.kind]}: {e}"
        if primary.name == "xgrammar" and spec.kind in ("json", "regex"):
            try:
                compiled = self._backend("llguidance").compile(spec)
            except ValueError:
                raise ValueError(error) from None  # the primary compiler's message
            logger.info("xgrammar rejected a %s (%s); compiled with llguidance", spec.kind, error)
            return compiled
        raise ValueError(error)

    def _backend(self, name: str) -> GrammarBackend:
        with self._backend_lock:
            if name not in self._backends:
                if name == "xgrammar":
                    self._backends[name] = XGrammarBackend(self._vocab_info())
                else:
                    self._backends[name] = LLGuidanceBackend(self.hf, self.vocab_size, self.stop_ids)
            return self._backends[name]

    def _vocab_info(self) -> Any:
        """xgrammar's TokenizerInfo (also the source of token bytes for any backend)."""
        if self._info is None:
            self._info = _xgrammar_tokenizer_info(self.hf, self.vocab_size, self.stop_ids)
        return self._info

    @staticmethod
    def matcher_of(req: Request) -> Matcher | None:
        """The request's matcher, waiting for its compile the first time it is needed
        (until then `req.grammar` holds the compile's future). ValueError if it failed."""
        if isinstance(req.grammar, Future):
            req.grammar = req.grammar.result().new_matcher()
        return req.grammar

    def accept(self, req: Request, token: int) -> bool:
        """Advance the request's matcher by its newly appended token."""
        if self.matcher_of(req).accept(token):
            return True
        logger.error("request %s: sampled token %d is not allowed by its grammar",
                     req.request_id, token)
        return False

    @staticmethod
    def is_terminated(req: Request) -> bool:
        return not isinstance(req.grammar, Future) and req.grammar.is_terminated

    # -- per step -------------------------------------------------------------------------

    def token_masks(self, reqs: list[Request]) -> tuple[torch.Tensor | None, list[Request]]:
        """Bool [len(reqs), vocab] of allowed tokens on the device (None when no request is
        constrained), and the requests whose grammar failed to compile."""
        by_type: dict[type, tuple[list[Matcher], list[int]]] = {}
        failed = []
        for row, req in enumerate(reqs):
            if req.grammar is None:
                continue
            try:
                matcher = self.matcher_of(req)
            except ValueError:
                failed.append(req)
                continue
            group = by_type.setdefault(type(matcher), ([], []))
            group[0].append(matcher)
            group[1].append(row)
        if not by_type:
            return None, failed
        words = (self.vocab_size + 31) // 32
        # Pinned, so the upload does not block the host until the step's forward is done:
        # the unpack and the sampling kernels queue behind it meanwhile.
        pinned = self.device.type == "cuda"
        bitmask = torch.full((len(reqs), words), -1, dtype=torch.int32,  # -1: all allowed
                             pin_memory=pinned)
        for cls, (matchers, rows) in by_type.items():
            cls.fill_bitmask(matchers, bitmask, rows)
        return self.unpack(bitmask.to(self.device, non_blocking=pinned)), failed

    def unpack(self, bitmask: torch.Tensor) -> torch.Tensor:
        """Packed int32 [B, ceil(V/32)] (bit j of word w = token 32w + j) -> bool [B, V]."""
        bits = (bitmask.unsqueeze(-1) >> self._shifts) & 1
        return bits.view(bitmask.shape[0], -1)[:, :self.vocab_size].bool()

    def jump_forward(self, req: Request, last_token: int, limit: int) -> list[int]:
        """Accept and return the tokens the grammar forces after `last_token` (at most
        `limit`, cut after a stop token id), or [] when there are none or the boundary is
        not clean. Requests asking for logprobs never jump: skipped tokens have none."""
        p = req.params
        if not self.enable_jump_forward or p.logprobs or p.top_logprobs or limit <= 0:
            return []
        matcher = self.matcher_of(req)
        forced = matcher.jump_forward_tokens()[:limit]
        if not forced or not self._clean_boundary(last_token, forced):
            return []
        cut = next((i + 1 for i, t in enumerate(forced) if t in p.stop_token_ids), len(forced))
        accepted = []
        for token in forced[:cut]:
            if not matcher.accept(token):
                break  # cannot happen for forced text; stop at a valid prefix if it does
            accepted.append(token)
        return accepted

    def _clean_boundary(self, last_token: int, forced: list[int]) -> bool:
        """True when no vocabulary token starts with the last sampled token's bytes plus the
        first forced byte. Otherwise a tokenizer would have merged them into a longer token:
        we skip the jump this step and let the model pick that token (still constrained), so
        the text keeps a tokenization the model knows. (xgrammar leaves out the last forced
        token by the same rule, which keeps the other end of the jump clean.)"""
        token_bytes = self._vocab_bytes()
        head = b"".join(token_bytes[t] for t in forced)[:1]
        prefix = token_bytes[last_token] + head
        i = bisect.bisect_left(self._sorted_tokens, prefix)
        return i == len(self._sorted_tokens) or not self._sorted_tokens[i].startswith(prefix)

    def _vocab_bytes(self) -> list[bytes]:
        if self._token_bytes is None:
            with self._backend_lock:
                vocab = list(self._vocab_info().decoded_vocab)
            self._sorted_tokens = sorted(t for i, t in enumerate(vocab)
                                         if t and i not in self.stop_ids)
            self._token_bytes = vocab
        return self._token_bytes
