"""Drafts from a smaller model (`speculative_algorithm="draft_model"`): it runs up to
`speculative_num_steps` forwards ahead of the target each step, batched over all drafting
requests (one catch-up extend, then one decode forward per further draft token), with its
own ModelRunner, KV pool and radix cache (engine/speculative/draft_kv.py).

Greedy requests draft by argmax. Sampled requests draw each draft from the draft's own
distribution at the request's temperature / top-k / top-p (the engine's Sampler), and that
distribution `q` goes to rejection sampling (verify.py), so the output follows the
target's distribution exactly. A constrained request drafts under its grammar: the draft's
logits are masked with the grammar state after the drafts before (its matcher advanced
through them, rolled back after the step), so `q` is the masked distribution the target's
masked one is compared against, and drafting stops at a token that ends the grammar.

On a GPU the draft replays its own CUDA graphs as the target does (decode forwards and
short catch-up extends: a small model's eager forward is all launch overhead), and runs on
rank 0 only at tp > 1 (the rank that samples). On a GPU whose KV pool is sized
from `mem_fraction_static`, `draft_memory_reserve` tells the target's pool sizing what the
draft's weights and its pool (as many slots as the target's) take."""
from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import torch

from engine.config import EngineConfig
from engine.grammar import Grammars
from engine.attention.kv_pool import KVPool
from engine.kernels.argmax import argmax_rows
from engine.executor.kv_sizing import MemoryReserve, kv_shape
from engine.loading.hf_config import load_hf_config, resolve_device, resolve_dtype
from engine.quantization.fp8 import FP8
from engine.core.request import Request
from engine.executor.sampler import Sampler
from engine.speculative.constrained import matcher_or_none
from engine.speculative.draft_kv import DraftKV, DraftSeq
from engine.speculative.proposer import Proposer
from engine.executor.step_input import PendingTokens
from engine.core.step_plan import Chunk, StepPlan

if TYPE_CHECKING:
    from engine.speculative.target import TargetRunner


def load_draft_config(config: EngineConfig):
    """The draft's HF config, or a ValueError that names the setting."""
    path = config.speculative_draft_model
    try:
        return load_hf_config(path)
    except (OSError, ValueError) as e:  # (FileNotFoundError is an OSError)
        raise ValueError(f"speculative_draft_model={path!r} cannot be loaded: {e}") from e


def draft_memory_reserve(config: EngineConfig) -> MemoryReserve:
    """What the draft model takes of the memory budget the target's KV pool is sized from:
    its weights (counted from its config, at the dtype it loads in) and its KV per slot."""
    hf = load_draft_config(config)
    dtype = resolve_dtype(config.dtype, hf, resolve_device(config.device))
    kv_dtype = FP8 if config.kv_cache_dtype == "fp8_e4m3" else dtype
    per_token = KVPool.bytes_per_token(*kv_shape(hf, 1), kv_dtype)
    weight_bytes = _param_count(hf) * torch.tensor([], dtype=dtype).element_size()
    return MemoryReserve(fixed_bytes=weight_bytes, bytes_per_token=per_token)


def _param_count(hf) -> int:
    """Parameters of a dense Llama-family model (an estimate for others)."""
    h, layers = hf.hidden_size, hf.num_hidden_layers
    heads, (_, kv_heads, head_dim) = hf.num_attention_heads, kv_shape(hf, 1)
    attention = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim
    mlp = 3 * h * hf.intermediate_size
    embeddings = hf.vocab_size * h * (1 if getattr(hf, "tie_word_embeddings", False) else 2)
    return layers * (attention + mlp + 2 * h) + embeddings + h  # (+ the RMSNorm weights)


def draft_runner_config(config: EngineConfig, num_slots: int, max_context: int) -> EngineConfig:
    """The target's settings with the draft's model, pool size and context; one rank, no
    radix-grouped decode (its steps are small), no speculation of its own."""
    return dataclasses.replace(
        config, model=config.speculative_draft_model, tokenizer=None, max_total_tokens=num_slots,
        max_model_len=max_context, tp_size=1, enable_prefix_grouped_decode=False,
        enable_warmup=False, speculative_algorithm=None, speculative_draft_model=None)


class DraftModelProposer(Proposer):
    def __init__(self, config: EngineConfig, sampler: Sampler, target: TargetRunner,
                 grammars: Grammars) -> None:
        hf = load_draft_config(config)
        if hf.vocab_size != target.vocab_size:
            raise ValueError(
                f"speculative_draft_model={config.speculative_draft_model!r} has a vocabulary "
                f"of {hf.vocab_size} tokens, the target {config.model!r} {target.vocab_size}: "
                "the draft must share the target's tokenizer")
        max_context = min(target.max_context, hf.max_position_embeddings)
        # A runner of the target's kind (the engine builds the target's and hands it in).
        runner_class = type(target)
        self.runner = runner_class(draft_runner_config(config, target.kv_pool.num_slots, max_context),
                                   load_model=target.load_model)
        self.kv = DraftKV(self.runner.kv_pool.allocator, config.max_running_requests,
                          config.enable_radix_cache)
        self.sampler = sampler
        self.grammars = grammars
        # Tokens one catch-up forward computes at most (a long prompt is caught up in
        # chunks, as the target prefills it), unless every request has one token left.
        self.catch_up_budget = config.chunked_prefill_size if config.chunked_prefill_size > 0 \
            else config.max_prefill_tokens
        self._probs: dict[Request, list[torch.Tensor]] = {}  # this step's q rows per request
        self.forwards = 0  # draft forwards, each over the whole batch (catch-up chunks too)
        self.seconds = 0.0  # wall time of drafting, sampling included

    # -- drafting ---------------------------------------------------------------------------

    def propose_batch(self, reqs: list[Request], rooms: list[int]) -> list[list[int]]:
        self._probs.clear()
        t0 = time.perf_counter()
        picked = self._pick_requests(reqs, rooms)
        # The first forward catches every request up to its last token; then one decode
        # forward per further draft position, over the requests with room left.
        self._catch_up_long([seq for _, seq, _ in picked])
        if any(req.grammar is not None for req, _, _ in picked):
            drafts = self._draft_walking(picked)  # (the whole batch: its forwards are shared)
        else:
            drafts = self._draft_chained(picked)
        self.seconds += time.perf_counter() - t0
        return [drafts.get(req, []) for req in reqs]

    def _first_chunks(self, picked: list[tuple[Request, DraftSeq, int]]) -> list[Chunk]:
        return [self.kv.grow(seq, len(seq.token_ids) - len(seq.kv.slots)) for _, seq, _ in picked]

    def _share_prompt(self, seq: DraftSeq) -> None:
        if seq.fresh:  # its prompt's KV exists now: share it
            seq.fresh = False
            self.kv.cache_verified(seq)

    def _draft_chained(self, picked: list[tuple[Request, DraftSeq, int]]) -> dict[Request, list[int]]:
        """Each forward's tokens stay on the device and are the next forward's inputs (the
        runner's in-flight tokens, as under overlap scheduling); the host reads every draft
        once at the end. On a GPU that takes a host round trip per draft token out of the
        loop: at batch 1 a 1B draft's step was ~0.6 ms of GPU in ~1.6 ms."""
        chunks, pending = self._first_chunks(picked), None
        steps: list[tuple[list[tuple[Request, DraftSeq, int]], torch.Tensor]] = []
        try:
            while picked:
                tokens = self._forward_tokens(chunks, [req for req, _, _ in picked], pending)
                steps.append((picked, tokens))
                for _, seq, _ in picked:
                    self._share_prompt(seq)
                pending = PendingTokens(tokens, {seq: i for i, (_, seq, _) in enumerate(picked)})
                picked = [p for p in picked if p[2] > len(steps)]
                for _, seq, _ in picked:
                    seq.inflight = 1  # its input is in `pending`, not in token_ids yet
                chunks = [self.kv.grow(seq, 1) for _, seq, _ in picked]
        finally:
            for rows, _ in steps:
                for _, seq, _ in rows:
                    seq.inflight = 0
        drafts: dict[Request, list[int]] = {}
        values = iter(torch.cat([t for _, t in steps]).tolist()) if steps else iter(())
        for rows, _ in steps:
            for (req, seq, _), token in zip(rows, values):
                drafts.setdefault(req, []).append(token)
                seq.token_ids.append(token)
        return drafts

    def _draft_walking(self, picked: list[tuple[Request, DraftSeq, int]]) -> dict[Request, list[int]]:
        """One forward at a time with its tokens read on the host: a constrained request's
        matcher walks each draft before the next forward's mask."""
        drafts: dict[Request, list[int]] = {req: [] for req, _, _ in picked}
        chunks = self._first_chunks(picked)
        walked: dict[Request, int] = {}  # drafts each constrained request's matcher took
        try:
            while picked:
                tokens = self._forward_tokens(chunks, [req for req, _, _ in picked]).tolist()
                ended = set()
                for (req, seq, _), token in zip(picked, tokens):
                    drafts[req].append(token)
                    seq.token_ids.append(token)
                    self._share_prompt(seq)
                    if req.grammar is not None and not self._walk(req, token, walked):
                        ended.add(req)
                picked = [p for p in picked if len(drafts[p[0]]) < p[2] and p[0] not in ended]
                chunks = [self.kv.grow(seq, 1) for _, seq, _ in picked]
        finally:
            for req, n in walked.items():
                self.grammars.matcher_of(req).rollback(n)
        return drafts

    def _walk(self, req: Request, token: int, walked: dict[Request, int]) -> bool:
        """Advance the request's matcher by its draft token; False when drafting must stop
        there (the grammar refused, ended or would jump forward after it, or failed to
        compile): `cut_to_grammar` cuts the draft before that token."""
        matcher = matcher_or_none(self.grammars, req)
        if matcher is None or not matcher.accept(token):
            return False
        walked[req] = walked.get(req, 0) + 1
        return not (matcher.is_terminated or self.grammars.would_jump(req, token))

    def _pick_requests(self, reqs: list[Request], rooms: list[int]
                       ) -> list[tuple[Request, DraftSeq, int]]:
        """The requests the draft serves this step, with their seqs brought up to date and
        the KV they need reserved (catch-up + room - 1 slots)."""
        seqs = []
        for req, room in zip(reqs, rooms):
            room = min(room, self.runner.max_context - len(req.token_ids))
            seq = self.kv.open(req) if room > 0 else None
            if seq is not None:
                seqs.append((req, seq, room))
        picked, available = [], self.kv.available  # (after every open: they lock prefixes)
        for req, seq, room in seqs:
            catch_up = len(seq.token_ids) - len(seq.kv.slots)
            need = catch_up + room - 1
            if catch_up > 0 and need <= available:
                available -= need
                picked.append((req, seq, room))
        return picked

    def _catch_up_long(self, seqs: list[DraftSeq]) -> None:
        """While the seqs' catch-ups add up to more than the budget, compute KV for up to
        the budget's worth of them (leaving each seq's last token to the drafting forward)."""
        def behind(seq: DraftSeq) -> int:
            return len(seq.token_ids) - len(seq.kv.slots)

        while sum(behind(seq) for seq in seqs) > self.catch_up_budget:
            chunks, budget = [], self.catch_up_budget
            for seq in seqs:
                n = min(behind(seq) - 1, budget)
                if n > 0:
                    chunks.append(self.kv.grow(seq, n))
                    budget -= n
            if not chunks:
                return
            self.runner.forward(StepPlan(chunks))  # (KV only: the logits are not needed)
            self.forwards += 1

    @torch.inference_mode()
    def _forward_tokens(self, chunks: list[Chunk], reqs: list[Request],
                        pending: PendingTokens | None = None) -> torch.Tensor:
        """One draft forward: each chunk's next token, on the device (argmax, or drawn from
        q), under the grammar state after the drafts so far for constrained requests."""
        logits, _ = self.runner.forward(StepPlan(chunks), pending)
        self.forwards += 1
        masks, _ = self.grammars.token_masks(reqs)
        if masks is not None:
            logits = logits.masked_fill(~masks, float("-inf"))
        greedy = [r.params.is_greedy for r in reqs]
        if all(greedy):
            return argmax_rows(logits)
        q = self.sampler.probs(logits, [r.params for r in reqs])
        q = q / q.sum(dim=-1, keepdim=True)  # what `draw` samples from, normalised
        drawn = self.sampler.draw(q, reqs)
        for i, req in enumerate(reqs):
            if not greedy[i]:
                self._probs.setdefault(req, []).append(q[i])
        return torch.where(torch.tensor(greedy, device=logits.device), argmax_rows(logits), drawn)

    # -- verification hooks -------------------------------------------------------------------

    def draft_probs(self, req: Request, n: int) -> torch.Tensor | None:
        rows = self._probs.get(req)
        return torch.stack(rows[:n]) if rows else None

    def on_verified(self, reqs: list[Request]) -> None:
        """Free the draft KV of what the target did not keep (requests that finished were
        released already)."""
        for req in reqs:
            seq = self.kv.seqs.get(req)
            if seq is not None:
                self.kv.sync(seq, req)
        self._probs.clear()

    def release(self, req: Request) -> None:
        self.kv.release(req)

    def counters(self) -> dict:
        pool = self.runner.kv_pool
        return {"spec_draft_forwards": self.forwards, "spec_draft_seconds": self.seconds,
                "spec_draft_prefill_tokens": self.kv.prefill_tokens,
                "spec_draft_cached_tokens": self.kv.cached_tokens,
                "spec_draft_free_slots": pool.allocator.num_free,
                "spec_draft_evictable_slots": self.kv.cache.evictable_size,
                "spec_draft_total_slots": pool.num_slots}

    def flush_cache(self) -> None:
        self.kv.cache.reset()

    def reset(self) -> None:
        self.flush_cache()
        self.forwards, self.seconds = 0, 0.0
        self.kv.prefill_tokens = self.kv.cached_tokens = 0
