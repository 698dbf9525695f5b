"""`Grammars`: the engine's entry point to structured output. It compiles constraints on a
small pool (cached by constraint), builds each step's token masks, and finds jump-forward
tokens."""
from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from engine.grammar.after_text import AfterText
from engine.grammar.base import CompiledGrammar, GrammarBackend, GrammarSpec, Matcher
from engine.grammar.llguidance_backend import LLGuidanceBackend
from engine.grammar.xgrammar_backend import XGrammarBackend, xgrammar_tokenizer_info
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

BACKENDS = ("xgrammar", "llguidance", "none")
_CACHE_SIZE = 512  # compiled grammars (and compile errors) kept, least recently used out
# The name each constraint has in the API, for error messages.
_FIELD = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "ebnf": "ebnf"}


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
        self._compile_times: list[float] = []  # seconds, since the last drain_compile_times()

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

    def drain_compile_times(self) -> list[float]:
        """Durations of the compiles finished since the last call (for metrics)."""
        # One swap, no lock: compiles run in pool threads, and a duration appended while the
        # caller reads the old list is at worst not recorded (metrics are best effort).
        times, self._compile_times = self._compile_times, []
        return times

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        started = time.perf_counter()
        try:
            return self._compile_now(spec)
        finally:
            self._compile_times.append(time.perf_counter() - started)

    def _compile_now(self, spec: GrammarSpec) -> CompiledGrammar:
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
            self._info = xgrammar_tokenizer_info(self.hf, self.vocab_size, self.stop_ids)
        return self._info

    def matcher_of(self, req: Request) -> Matcher | None:
        """The request's matcher, waiting for its compile the first time it is needed
        (until then `req.grammar` holds the compile's future). ValueError if it failed."""
        if isinstance(req.grammar, Future):
            matcher = req.grammar.result().new_matcher()
            if req.params.grammar_after:  # free until the output writes it (reasoning)
                matcher = AfterText(matcher, req.params.grammar_after.encode(), self._vocab_bytes())
            req.grammar = matcher
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
        forced = self._forced_after(req, last_token, limit)
        if not forced:
            return []
        matcher = self.matcher_of(req)
        cut = next((i + 1 for i, t in enumerate(forced) if t in p.stop_token_ids), len(forced))
        accepted = []
        for token in forced[:cut]:
            if not matcher.accept(token):
                break  # cannot happen for forced text; stop at a valid prefix if it does
            accepted.append(token)
        return accepted

    def would_jump(self, req: Request, last_token: int) -> bool:
        """Whether `jump_forward` would append forced tokens after `last_token` (the
        request's matcher already advanced by it), without advancing anything. Speculative
        drafts stop before such a token: plain decoding jumps after it rather than decode."""
        return bool(self._forced_after(req, last_token, 1))

    def _forced_after(self, req: Request, last_token: int, limit: int) -> list[int]:
        """The forced tokens jump-forward would take after `last_token` (at most `limit`)."""
        p = req.params
        if not self.enable_jump_forward or p.logprobs or p.top_logprobs or limit <= 0:
            return []
        forced = self.matcher_of(req).jump_forward_tokens()[:limit]
        if not forced or not self._clean_boundary(last_token, forced):
            return []
        return forced

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
