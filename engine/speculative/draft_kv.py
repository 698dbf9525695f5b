"""The draft model's KV, per request, in the draft's own pool.

A drafting request has a `DraftSeq`: KV for the tokens the draft has seen, in a row of
the draft runner's req_to_token table. Each step the draft first catches up (one extend
over the request's tokens it has no KV for: its prompt at first, then the tokens verified
since), then drafts one token per forward. After verification the KV of drafts the target
did not keep is freed (`sync`), so the draft's KV is always a prefix of the request's
tokens plus this step's drafts. Prompt prefixes are shared through the draft's own
RadixCache, as the target shares them through its own: a request starts from the longest
cached prefix of its tokens, and its verified KV goes into the tree once computed (after
its first catch-up) and when it stops running.

Ownership mirrors the target's (docs/architecture.md, "Ownership of KV slots"): a slot is
free, in the tree, or owned by one DraftSeq (`kv.slots[kv.locked_len:]`)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.slot_allocator import SlotAllocator
from engine.core.radix_cache import RadixCache
from engine.core.request import KVRecord, Request
from engine.core.step_plan import Chunk


@dataclass(eq=False)
class DraftSeq:
    """The draft's view of one request: `token_ids` are the request's tokens as of the
    last `sync` (the first `verified` of them), then this step's drafts; KV exists for
    token_ids[:len(kv.slots)]. Has the fields of `Request` the batch builder reads, so the
    draft runner builds its steps from plain `Chunk`s over DraftSeqs."""

    token_ids: list[int]
    kv: KVRecord
    verified: int
    fresh: bool = True  # its first catch-up (the prompt) is not in the tree yet
    inflight: int = 0
    prompt_logprobs: None = None


class DraftKV:
    def __init__(self, allocator: SlotAllocator, max_rows: int, cache_enabled: bool) -> None:
        self.allocator = allocator
        self.cache = RadixCache(allocator, enabled=cache_enabled)
        self.free_rows = list(range(max_rows, 0, -1))  # row 0 pads, as the target's table
        self.seqs: dict[Request, DraftSeq] = {}
        self.prefill_tokens = 0  # catch-up tokens of fresh seqs, cached ones included
        self.cached_tokens = 0  # of those, served by the draft's radix cache

    def open(self, req: Request) -> DraftSeq | None:
        """The request's DraftSeq, brought up to its tokens (KV of rejected drafts freed);
        a new one starts from the longest cached prefix. None when no row is free."""
        seq = self.seqs.get(req)
        if seq is not None:
            self.sync(seq, req)
            return seq
        if not self.free_rows:
            return None
        # The last token is always computed: its logits give the first draft.
        slots, node = self.cache.match_prefix(req.token_ids[:-1])
        self.cache.lock(node)
        kv = KVRecord(row=self.free_rows.pop(), slots=list(slots), locked_len=len(slots), node=node)
        self.prefill_tokens += len(req.token_ids)
        self.cached_tokens += len(slots)
        seq = self.seqs[req] = DraftSeq(list(req.token_ids), kv, verified=len(req.token_ids))
        return seq

    def sync(self, seq: DraftSeq, req: Request) -> None:
        """Keep the KV of the longest common prefix of the seq's tokens and the request's
        (request tokens only grow, so compare from the last verified point on)."""
        n, end = seq.verified, min(len(seq.kv.slots), len(req.token_ids))
        while n < end and seq.token_ids[n] == req.token_ids[n]:
            n += 1
        kv = seq.kv
        # The last token is recomputed (its logits give the first draft); the tree's
        # tokens are verified ones and never cut.
        n = max(min(n, len(req.token_ids) - 1), kv.locked_len)
        self.allocator.free(kv.slots[n:])
        del kv.slots[n:]
        kv.row_valid = min(kv.row_valid, n)
        seq.token_ids = list(req.token_ids)
        seq.verified = len(seq.token_ids)

    @property
    def available(self) -> int:
        return self.allocator.num_free + self.cache.evictable_size

    def grow(self, seq: DraftSeq, n: int) -> Chunk:
        """A chunk computing the KV of the seq's next n tokens (slots allocated, evicting
        unlocked tree leaves if needed; the caller checked `available`)."""
        kv = seq.kv
        if self.allocator.num_free < n:
            self.cache.evict(n - self.allocator.num_free)
        slots = self.allocator.alloc(n)
        assert slots is not None, "draft KV pool over-committed"
        chunk = Chunk(seq, len(kv.slots), n, row_from=kv.row_valid)
        kv.slots += slots
        kv.row_valid = chunk.start + n
        return chunk

    def cache_verified(self, seq: DraftSeq) -> None:
        """Put the seq's verified KV into the tree (locked by the seq), so requests with
        the same prefix start from it."""
        kv = seq.kv
        n = min(len(kv.slots), seq.verified)
        if not self.cache.enabled or n <= kv.locked_len:
            return
        tokens = seq.token_ids[:n]
        already = self.cache.insert(tokens, kv.slots[:n])
        self.allocator.free(kv.slots[kv.locked_len:already])  # the tree had its own copy
        slots, node = self.cache.match_prefix(tokens)
        self.cache.lock(node)
        self.cache.unlock(kv.node)
        kv.row_valid = min(kv.row_valid, kv.locked_len)  # slots swapped for the tree's from here
        kv.slots[:n] = slots
        kv.locked_len, kv.node = n, node

    def release(self, req: Request) -> None:
        """The request stopped running: its verified KV goes to the tree, the rest is freed."""
        seq = self.seqs.pop(req, None)
        if seq is None:
            return
        self.cache_verified(seq)
        kv = seq.kv
        self.allocator.free(kv.slots[kv.locked_len:])
        self.cache.unlock(kv.node)
        self.free_rows.append(kv.row)

    def release_all(self) -> None:
        for req in list(self.seqs):
            self.release(req)
