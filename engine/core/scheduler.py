"""Continuous batching: which requests run this step, and with how many new tokens.

Every step is one forward over a ragged batch: each running request that is decoding gets
one new token, then prefill work (new requests, or the next chunk of a long prompt) fills a
token budget (`chunked_prefill_size`), so a long prompt never stalls the decoders for more
than one chunk. When the KV pool runs dry, the radix cache evicts unlocked leaves first;
if that is not enough, running requests are retracted (their KV freed, their tokens kept;
the lowest priority first, the newest first among equals) and re-queued at the front, so
they later finish with the same output.

Priorities (`priority_scheduling`): waiting requests are admitted in priority order, and
with "preempt" a waiting request that finds the batch full (no free row, or not enough KV
for its first chunk) retracts running requests of a strictly lower priority, as memory
pressure retracts them, until it fits. Requests still waiting for their first admission
past their queue deadline end before each step's plan (engine/core/queue_deadlines.py).

The scheduler owns each running request's KV record (`Request.kv`, engine/core/request.py): it
alone allocates, caches, moves and frees slots; the runner only reads the records.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from engine.core.admission import AdmissionOrder
from engine.config import EngineConfig
from engine.core.slot_allocator import SlotAllocator
from engine.core.queue_deadlines import QUEUE_TIMEOUT, QueueDeadlines
from engine.core.radix_cache import RadixCache
from engine.core.request import KVRecord, Request, Status
from engine.core.step_plan import Chunk, StepPlan

logger = logging.getLogger(__name__)

# Waiting requests that share this many leading tokens with one admitted in the same step
# wait one step, so they reuse its KV instead of computing the same prefix twice.
_IN_STEP_PREFIX = 64


class AdapterGate(Protocol):
    def acquire(self, req: Request) -> bool: ...

    def release(self, req: Request) -> None: ...


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    host_cached_tokens: int = 0  # of cached_tokens, those loaded back from the host tier
    generated_tokens: int = 0
    preemptions: int = 0  # retractions, for memory or for priority
    priority_preemptions: int = 0  # of them, those for a waiting higher-priority request
    queue_timeouts: int = 0
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
        self.admission_order = AdmissionOrder(config.schedule_policy, cache,
                                              by_priority=config.priority_scheduling != "off")
        self.deadlines = QueueDeadlines(config.max_queue_time_s)
        self.stats = SchedulerStats()
        # Called with each request whose KV is released (finish, abort, retraction), e.g.
        # so a speculative draft model frees that request's KV in its own pool.
        self.release_hooks: list[Callable[[Request], None]] = []
        # LoRA (engine/lora/manager.py): `acquire(req)` puts the request's adapter in a GPU
        # slot and holds it there (False: every slot is held), `release(req)` lets it go.
        self.adapter_gate: AdapterGate | None = None

    # -- queue --------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        # Prefetch: start loading its prefix from the host tier into free slots now, so
        # that it is on the device by the time the request is admitted.
        req.host_loaded += self.cache.load_back(req.token_ids[:-1], free_only=True,
                                                namespace=req.lora_id)
        self.waiting.append(req)
        self.deadlines.add(req)
        if req.params.priority:
            self.admission_order.saw_priority = True

    def expire_queued(self, now: float) -> list[Request]:
        """End the requests past their queue deadline (never admitted: nothing to free)."""
        expired = self.deadlines.expired(now)
        for req in expired:
            self.waiting.remove(req)
            req.status = Status.FINISHED
            req.finish_reason = QUEUE_TIMEOUT
            self.stats.queue_timeouts += 1
        return expired

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
        decode = self._decode_chunks(drafts)
        prefill = self._prefill_chunks(decode)  # (may retract requests of `decode`)
        chunks = decode + prefill
        while not chunks and self.running:
            # Every running request needs KV for several tokens (a prompt chunk, or text
            # appended by jump-forward) and none fits: retract one, as decode does.
            self._retract(max(self.running, key=_victim_order))
            chunks = self._prefill_chunks([])
        if not chunks:
            return None
        for chunk in chunks:  # the step writes each request's new row entries
            kv = chunk.req.kv
            chunk.row_from = kv.row_valid
            kv.row_valid = chunk.start + chunk.num_tokens
        self.stats.steps += 1
        return StepPlan(chunks)

    def _decode_chunks(self, drafts: dict[Request, list[int]] | None) -> list[Chunk]:
        """One new token for every request that has KV for all but its last token."""
        decoders = [r for r in self.running if len(r.token_ids) + r.inflight - len(r.kv.slots) == 1]
        decoders = self._make_room_for_decode(decoders)
        chunks = [Chunk(r, len(r.kv.slots), 1) for r in decoders]
        for req, slot in zip(decoders, self._alloc(len(decoders))):
            req.kv.slots.append(slot)
        if drafts:
            self._attach_drafts(chunks, drafts)
        return chunks

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
            chunk.req.kv.slots.extend(self._alloc(len(draft)))

    def _make_room_for_decode(self, decoders: list[Request]) -> list[Request]:
        while self._available() < len(decoders) and self.running:
            victim = max(self.running, key=_victim_order)
            self._retract(victim)
            if victim in decoders:
                decoders.remove(victim)
        return decoders

    def _prefill_chunks(self, decode: list[Chunk]) -> list[Chunk]:
        """Continue chunked prompts first, then admit waiting requests (in the policy's
        order: engine/core/admission.py), within the token budget and the free memory (keeping
        a slot for each of this step's `decode` chunks). Priority preemption may take
        chunks out of `decode`."""
        chunks: list[Chunk] = []
        for req in [r for r in self.running if r.pending_len > 1]:
            left = self._budget_left(chunks)
            n = self._fit(req.pending_len, left, bool(chunks), len(decode)) if left > 0 else None
            if n is None:
                return chunks
            chunks.append(self._extend(req, n))
        step_prefixes: set[tuple[int, ...]] = set()
        for req in self.admission_order(self.waiting):
            if self._budget_left(chunks) <= 0:
                break
            if req.inflight:
                continue  # retracted while its last token was in flight (overlap scheduling)
            if self._shares_prefix_in_step(req, step_prefixes):
                continue  # next step it hits the KV this step computes
            gate = self.adapter_gate
            if gate is not None and not gate.acquire(req):
                continue  # its LoRA adapter waits for a free slot of the GPU pool
            chunk = self._admit_preempting(req, decode, chunks)
            if chunk is None:
                if gate is not None:
                    gate.release(req)
                break
            chunks.append(chunk)
        return chunks

    def _budget_left(self, prefill: list[Chunk]) -> int:
        """New prompt tokens this step may still take, after the `prefill` chunks."""
        chunking = self.config.chunked_prefill_size > 0
        budget = self.config.chunked_prefill_size if chunking else self.config.max_prefill_tokens
        return budget - sum(c.num_tokens for c in prefill)

    def _admit_preempting(self, req: Request, decode: list[Chunk],
                          prefill: list[Chunk]) -> Chunk | None:
        """Admit `req` within the step's budget; while the batch is full, retract a running
        request of lower priority (dropping its chunk from this step) and retry."""
        while True:
            if len(self.running) < self.config.max_running_requests:
                left = self._budget_left(prefill)
                chunk = self._admit(req, left, bool(prefill), len(decode))
                if chunk is not None:
                    return chunk
            victim = self._priority_victim(req)
            if victim is None:
                return None
            self._retract(victim)
            self.stats.priority_preemptions += 1
            for chunks in (decode, prefill):
                chunks[:] = [c for c in chunks if c.req is not victim]

    def _priority_victim(self, req: Request) -> Request | None:
        """The running request `req` may retract: of those with a lower priority, the
        lowest, newest first. None when preemption is off or would not make room (the
        memory all lower-priority requests hold would still be short of `req`'s)."""
        if self.config.priority_scheduling != "preempt":
            return None
        lower = [r for r in self.running if r.params.priority > req.params.priority]
        if not lower:
            return None
        if len(self.running) < self.config.max_running_requests:  # short of memory, not rows
            need = len(req.token_ids) - self.cache.match_len(req.token_ids, req.lora_id)
            if self.config.chunked_prefill_size > 0:
                need = min(need, self.config.chunked_prefill_size)
            if self._available() + sum(len(r.kv.slots) for r in lower) < need:
                return None
        return max(lower, key=_victim_order)

    def _fit(self, pending: int, budget: int, others: bool, reserve: int) -> int | None:
        """How many of a request's `pending` tokens get KV this step (None: it does not
        fit the budget or the memory; `others`: the step has other prefill chunks)."""
        chunking = self.config.chunked_prefill_size > 0
        n = min(pending, budget) if chunking else pending
        too_big = not chunking and others and n > budget  # a lone prompt may exceed it
        if too_big or self._available() - reserve < n:
            return None
        return n

    def _shares_prefix_in_step(self, req: Request, step_prefixes: set) -> bool:
        """True when a request admitted this step starts with the same long prefix."""
        if not self.cache.enabled or len(req.token_ids) <= _IN_STEP_PREFIX:
            return False
        key = (req.lora_id, *req.token_ids[:_IN_STEP_PREFIX])
        if key in step_prefixes:
            return True
        step_prefixes.add(key)
        return False

    def _admit(self, req: Request, budget: int, others: bool, reserve: int) -> Chunk | None:
        """Start `req` from the longest cached prefix of its tokens, with its first chunk;
        None (and nothing changed) when that chunk does not fit."""
        reusable = len(req.token_ids) - 1
        if req.prompt_logprobs_from is not None:  # the logits before it must be computed
            reusable = min(reusable, req.prompt_logprobs_from - 1)
        req.host_loaded += self.cache.load_back(req.token_ids[:reusable], namespace=req.lora_id)
        slots, node = self.cache.match_prefix(req.token_ids[:reusable], req.lora_id)
        self.cache.lock(node)  # before measuring memory: locked slots are not evictable
        n = self._fit(len(req.token_ids) - len(slots), budget, others, reserve)
        if n is None:
            self.cache.unlock(node)
            return None
        req.kv = KVRecord(row=self.free_rows.pop(), slots=list(slots), locked_len=len(slots),
                          node=node)
        req.status = Status.RUNNING
        self.waiting.remove(req)
        self.running.append(req)
        if req.scheduled_at is None:
            req.scheduled_at = time.monotonic()
        if not req.admitted_once:
            req.admitted_once = True
            req.cached_tokens = min(len(slots), req.num_prompt)
            self.stats.prompt_tokens += req.num_prompt
            self.stats.cached_tokens += req.cached_tokens
            self.stats.host_cached_tokens += min(req.host_loaded, req.cached_tokens)
        return self._extend(req, n)

    def _extend(self, req: Request, n: int) -> Chunk:
        """The request's next n tokens, with new slots for their KV."""
        kv = req.kv
        chunk = Chunk(req, len(kv.slots), n)
        kv.slots.extend(self._alloc(n))
        return chunk

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
        kv = req.kv
        tokens = req.token_ids[:len(kv.slots)]  # (an in-flight token never ends a prefill chunk)
        already = self.cache.insert(tokens, kv.slots, req.lora_id)
        self.allocator.free(kv.slots[kv.locked_len:already])  # the tree had its own copy
        slots, node = self.cache.match_prefix(tokens, req.lora_id)
        self.cache.lock(node)
        self.cache.unlock(kv.node)
        # From the old locked length on, the request's slots are swapped for the tree's.
        kv.row_valid = min(kv.row_valid, kv.locked_len)
        kv.slots, kv.locked_len, kv.node = list(slots), len(slots), node

    def detach_kv(self, req: Request, at: int, keep: int) -> list[int]:
        """Speculative verification: free the request's slots from `at + keep` on (the
        rejected drafts) and take the `keep` before them out of its record; the caller
        gives each back (`reattach_kv`) as its token is taken, or frees it."""
        kv = req.kv
        held = kv.slots[at:at + keep]
        self.allocator.free(kv.slots[at + keep:])
        del kv.slots[at:]
        kv.row_valid = min(kv.row_valid, at + keep)  # reattached slots return to their place
        return held

    def reattach_kv(self, req: Request, slot: int) -> None:
        req.kv.slots.append(slot)

    def free_slots(self, slots: list[int]) -> None:
        self.allocator.free(slots)

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
        kv, req.kv = req.kv, None
        owned_from = kv.locked_len
        # The KV of a token still in flight is freed, not cached: the tree keys known tokens.
        n = min(len(kv.slots), len(req.token_ids)) if keep and self.cache.enabled else 0
        if n:
            already = self.cache.insert(req.token_ids[:n], kv.slots[:n], req.lora_id)
            owned_from = max(owned_from, already)
            self.allocator.free(kv.slots[kv.locked_len:owned_from])
            owned_from = n  # the tree owns the rest now
        self.allocator.free(kv.slots[owned_from:])
        self.cache.unlock(kv.node)
        self.free_rows.append(kv.row)
        for hook in self.release_hooks:
            hook(req)

    def _retract(self, req: Request) -> None:
        logger.debug("retracting %s to free KV", req.request_id)
        self.running.remove(req)
        self._release_kv(req, keep=False)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)


def _victim_order(req: Request) -> tuple[int, float]:
    """Retraction order (the max goes first): the lowest priority, then the newest."""
    return req.params.priority, req.arrival
