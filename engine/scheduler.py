"""Continuous batching: which requests run this step, and with how many new tokens.

Every step is one forward over a ragged batch: each running request that is decoding gets
one new token, then prefill work (new requests, or the next chunk of a long prompt) fills a
token budget (`chunked_prefill_size`), so a long prompt never stalls the decoders for more
than one chunk. When the KV pool runs dry, the radix cache evicts unlocked leaves first;
if that is not enough, the newest running requests are retracted (their KV freed, their
tokens kept) and re-queued at the front, so they later finish with the same output.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv_pool import SlotAllocator
from engine.radix_cache import RadixCache
from engine.request import Request, Status

logger = logging.getLogger(__name__)

# Waiting requests that share this many leading tokens with one admitted in the same step
# wait one step, so they reuse its KV instead of computing the same prefix twice.
_IN_STEP_PREFIX = 64


@dataclass
class Chunk:
    """`num_tokens` new tokens of `req`, starting at sequence position `start`. A decode
    chunk may carry speculative `draft` tokens after the request's last token: they are
    fed too (counted in `num_tokens`) and every position's logits come back to verify them."""

    req: Request
    start: int
    num_tokens: int
    draft: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the request's tokens, so its last logits are sampled."""
        return self.start + self.num_tokens - len(self.draft) == self.req.num_tokens


@dataclass
class StepPlan:
    chunks: list[Chunk]

    @property
    def is_decode(self) -> bool:
        return all(c.num_tokens == 1 for c in self.chunks)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    steps: int = 0  # plans handed out


class Scheduler:
    def __init__(self, config: EngineConfig, allocator: SlotAllocator, cache: RadixCache) -> None:
        self.config = config
        self.allocator = allocator
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Row 0 of req_to_token is the padding row; running requests use 1..max_running.
        self.free_rows = list(range(config.max_running_requests, 0, -1))
        self.stats = SchedulerStats()

    # -- queue --------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def abort(self, req: Request) -> None:
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self._release_kv(req, keep=True)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = "abort"
        req.inflight = 0  # a token still in flight is dropped
        self.stats.aborted_requests += 1

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- planning -----------------------------------------------------------------------

    def schedule(self, drafts: dict[Request, list[int]] | None = None) -> StepPlan | None:
        """`drafts`: speculative tokens to verify after some decoding requests' last token
        (engine/speculative/); they get KV slots only when memory allows."""
        decoders = [r for r in self.running if len(r.token_ids) + r.inflight - len(r.slots) == 1]
        decoders = self._make_room_for_decode(decoders)
        chunks = [Chunk(r, len(r.slots), 1) for r in decoders]
        for req, slot in zip(decoders, self._alloc(len(decoders))):
            req.slots.append(slot)
        if drafts:
            self._attach_drafts(chunks, drafts)
        chunks += self._schedule_prefill(reserve=len(chunks))
        if not chunks and self.running:
            # Every running request needs KV for several tokens (a prompt chunk, or text
            # appended by jump-forward) and none fits: retract the newest, as decode does.
            self._retract(max(self.running, key=lambda r: r.arrival))
            return self.schedule(drafts)
        if not chunks:
            return None
        self.stats.steps += 1
        return StepPlan(chunks)

    def _attach_drafts(self, chunks: list[Chunk], drafts: dict[Request, list[int]]) -> None:
        """Give decode chunks their drafts, in order, while memory lasts: a draft is an
        optimisation, so it never retracts a request (it may evict unlocked cache leaves,
        as any allocation does)."""
        for chunk in chunks:
            draft = drafts.get(chunk.req)
            if not draft or self._available() < len(draft):
                continue
            chunk.draft = list(draft)
            chunk.num_tokens += len(draft)
            chunk.req.slots.extend(self._alloc(len(draft)))

    def _make_room_for_decode(self, decoders: list[Request]) -> list[Request]:
        while self._available() < len(decoders) and self.running:
            victim = max(self.running, key=lambda r: r.arrival)
            self._retract(victim)
            if victim in decoders:
                decoders.remove(victim)
        return decoders

    def _schedule_prefill(self, reserve: int) -> list[Chunk]:
        """Continue chunked prompts first, then admit waiting requests in order, within the
        token budget and the free memory (keeping `reserve` slots for this step's decoders)."""
        chunking = self.config.chunked_prefill_size > 0
        budget = self.config.chunked_prefill_size if chunking else self.config.max_prefill_tokens
        chunks: list[Chunk] = []
        candidates = [r for r in self.running if r.pending_len > 1] + list(self.waiting)
        step_prefixes: set[tuple[int, ...]] = set()
        for req in candidates:
            if budget <= 0:
                break
            newly_admitted = req.status is Status.WAITING
            if newly_admitted and req.inflight:
                continue  # retracted while its last token was in flight (overlap scheduling)
            if newly_admitted:
                if len(self.running) >= self.config.max_running_requests:
                    break
                if self._shares_prefix_in_step(req, step_prefixes):
                    continue  # next step it hits the KV this step computes
                self._admit(req)
            n = min(req.pending_len, budget) if chunking else req.pending_len
            too_big = not chunking and chunks and n > budget  # a lone prompt may exceed it
            if too_big or self._available() - reserve < n:
                if newly_admitted:
                    self._unadmit(req)
                break
            chunks.append(Chunk(req, req.kv_len, n))
            req.slots.extend(self._alloc(n))
            budget -= n
        return chunks

    def _shares_prefix_in_step(self, req: Request, step_prefixes: set) -> bool:
        """True when a request admitted this step starts with the same long prefix."""
        if not self.cache.enabled or len(req.token_ids) <= _IN_STEP_PREFIX:
            return False
        key = tuple(req.token_ids[:_IN_STEP_PREFIX])
        if key in step_prefixes:
            return True
        step_prefixes.add(key)
        return False

    def _admit(self, req: Request) -> None:
        if req.scheduled_at is None:
            req.scheduled_at = time.monotonic()
        reusable = len(req.token_ids) - 1
        if req.prompt_logprobs_from is not None:  # the logits before it must be computed
            reusable = min(reusable, req.prompt_logprobs_from - 1)
        slots, node = self.cache.match_prefix(req.token_ids[:reusable])
        self.cache.lock(node)
        req.slots, req.locked_len, req.last_node = list(slots), len(slots), node
        req.row, req.row_synced = self.free_rows.pop(), 0
        req.status = Status.RUNNING
        self.waiting.remove(req)
        self.running.append(req)
        if not req.admitted_once:
            req.admitted_once = True
            req.cached_tokens = min(len(slots), req.num_prompt)
            self.stats.prompt_tokens += req.num_prompt
            self.stats.cached_tokens += req.cached_tokens

    def _unadmit(self, req: Request) -> None:
        """Undo an admission that found no memory (nothing was computed yet)."""
        self.running.remove(req)
        self._release_kv(req, keep=False)
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        if req.num_preemptions == 0 and req.num_output == 0:
            req.admitted_once = False
            self.stats.prompt_tokens -= req.num_prompt
            self.stats.cached_tokens -= req.cached_tokens

    def _available(self) -> int:
        return self.allocator.num_free + self.cache.evictable_size

    def _alloc(self, n: int) -> list[int]:
        if self.allocator.num_free < n:
            self.cache.evict(n - self.allocator.num_free)
        slots = self.allocator.alloc(n)
        assert slots is not None, "scheduler admitted more tokens than the pool holds"
        return slots

    # -- after a step -------------------------------------------------------------------

    def cache_prefix(self, req: Request) -> None:
        """Put the request's computed KV into the tree (after a prefill chunk), so that
        requests arriving meanwhile can share it; the request keeps it locked."""
        if not self.cache.enabled:
            return
        tokens = req.token_ids[:req.kv_len]  # (an in-flight token never ends a prefill chunk)
        already = self.cache.insert(tokens, req.slots)
        self.allocator.free(req.slots[req.locked_len:already])  # the tree had its own copy
        slots, node = self.cache.match_prefix(tokens)
        self.cache.lock(node)
        self.cache.unlock(req.last_node)
        req.row_synced = min(req.row_synced, req.locked_len)
        req.slots, req.locked_len, req.last_node = list(slots), len(slots), node

    def finish(self, req: Request, reason: str) -> None:
        if req.status is Status.WAITING:  # retracted while its last token was in flight
            self.waiting.remove(req)
        else:
            self.running.remove(req)
            self._release_kv(req, keep=True)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.inflight = 0  # the token of a step launched after the finishing one is dropped
        self.stats.finished_requests += 1

    def _release_kv(self, req: Request, keep: bool) -> None:
        """Give back the request's row and KV; with `keep`, its KV goes into the tree."""
        owned_from = req.locked_len
        # The KV of a token still in flight is freed, not cached: the tree keys known tokens.
        n = min(req.kv_len, len(req.token_ids)) if keep and self.cache.enabled else 0
        if n:
            owned_from = max(owned_from, self.cache.insert(req.token_ids[:n], req.slots[:n]))
            self.allocator.free(req.slots[req.locked_len:owned_from])
            owned_from = n  # the tree owns the rest now
        self.allocator.free(req.slots[owned_from:])
        if req.last_node is not None:
            self.cache.unlock(req.last_node)
        req.slots, req.locked_len, req.last_node = [], 0, None
        if req.row is not None:
            self.free_rows.append(req.row)
            req.row = None

    def _retract(self, req: Request) -> None:
        logger.debug("retracting %s to free KV", req.request_id)
        self.running.remove(req)
        self._release_kv(req, keep=False)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)
