"""Which token prefixes each replica is believed to hold, as chained block hashes.

A prompt's token ids are cut into blocks of `block_size` tokens; block i's hash is
computed over block i-1's hash plus block i's tokens (`router.hashing`), so one hash names
the whole prefix up to the end of that block. Two prompts share a leading run of hashes
exactly as long as they share leading full blocks, and "longest cached prefix" becomes
"number of leading hashes present in a set".

The router keeps one such set per replica (`PrefixIndex`), replaced by each new report of
the replica's own truth (a `Digest` from `router.cache_digest`), so that every ingress's
router holds the same sets and evicted prefixes stop attracting traffic. `record_routed`
can add a router's own guesses between reports; the request router does not, because its
decisions must rest only on what every ingress knows alike.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Container, Hashable, Iterable, Sequence

from router.cache_digest import Digest
from router.hashing import DEFAULT_BLOCK_SIZE, block_hashes

DEFAULT_MAX_BLOCKS_PER_REPLICA = 1 << 18  # 256k blocks: ~4M tokens at B=16, ~40 MB

ReplicaKey = Hashable

# "Routed at" of an entry known only from a replica's digest: never counts as in flight.
_FROM_DIGEST = float("-inf")


def leading_matches(hashes: Sequence[int], held: Container[int]) -> int:
    """How many leading `hashes` are in `held` (the longest believed cached prefix)."""
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


class ReplicaBlocks:
    """The block hashes one replica is believed to hold, in recency order (oldest first),
    bounded by `max_blocks` (the oldest go first).

    Each entry remembers when the router last routed a request covering it (-inf when it
    is known only from a digest); `apply_digest` keeps recently routed entries because
    those requests may not have reached the replica's cache yet.
    """

    def __init__(self, max_blocks: int) -> None:
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self.max_blocks = max_blocks
        self.entries: OrderedDict[int, float] = OrderedDict()
        self.digest_version = -1  # last digest applied, to drop stale or repeated ones
        self.on_host: frozenset[int] = frozenset()  # held on its host tier only (last digest)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, h: object) -> bool:
        return h in self.entries

    def touch(self, hashes: Sequence[int], routed_at: float) -> None:
        # Deepest block first, root last: a prefix is then always at least as recent as
        # any of its extensions, so evicting the oldest entries trims leaves and never
        # leaves a hole at the front of a chain (which would zero its match).
        entries = self.entries
        for h in reversed(hashes):
            entries.pop(h, None)
            entries[h] = routed_at
        self._trim()

    def replace(self, digest_hashes: Sequence[int], keep_routed_after: float) -> None:
        """Believe exactly `digest_hashes` (oldest first), plus entries routed at or after
        `keep_routed_after`, which stay newest."""
        kept = [(h, t) for h, t in self.entries.items() if t >= keep_routed_after]
        fresh: OrderedDict[int, float] = OrderedDict.fromkeys(digest_hashes, _FROM_DIGEST)
        for h, t in kept:
            fresh.pop(h, None)
            fresh[h] = t
        self.entries = fresh
        self._trim()

    def _trim(self) -> None:
        while len(self.entries) > self.max_blocks:
            self.entries.popitem(last=False)


class PrefixIndex:
    """All replicas' believed caches. Plain Python, no Ray: the router owns one."""

    def __init__(
        self,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_blocks_per_replica: int = DEFAULT_MAX_BLOCKS_PER_REPLICA,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.max_blocks_per_replica = max_blocks_per_replica
        self._clock = clock
        self._replicas: dict[ReplicaKey, ReplicaBlocks] = {}

    def hashes(self, token_ids: Sequence[int]) -> list[int]:
        return block_hashes(token_ids, self.block_size)

    def match(
        self, hashes: Sequence[int], replica_ids: Iterable[ReplicaKey] | None = None
    ) -> dict[ReplicaKey, int]:
        """Matched leading blocks per replica: all known replicas, or exactly
        `replica_ids` (unknown ones match 0)."""
        ids = self._replicas.keys() if replica_ids is None else replica_ids
        out: dict[ReplicaKey, int] = {}
        for rid in ids:
            blocks = self._replicas.get(rid)
            out[rid] = leading_matches(hashes, blocks.entries) if blocks else 0
        return out

    def record_routed(
        self, replica_id: ReplicaKey, hashes: Sequence[int], now: float | None = None
    ) -> None:
        """A request with these block hashes was sent to `replica_id`: it will hold them."""
        blocks = self._blocks(replica_id)
        if hashes:
            blocks.touch(hashes, self._clock() if now is None else now)

    def forget_routed(self, replica_id: ReplicaKey, hashes: Sequence[int], routed_at: float) -> int:
        """Withdraw `record_routed(replica_id, hashes, routed_at)` (the request went elsewhere):
        drop the entries still stamped `routed_at`. Anything touched since (a later request,
        or a digest) stays; later touches of a chain cover a prefix of it, so what goes is a
        suffix and the believed set stays prefix-closed. Returns how many were dropped."""
        blocks = self._replicas.get(replica_id)
        if blocks is None:
            return 0
        dropped = 0
        for h in hashes:
            if blocks.entries.get(h) == routed_at:
                del blocks.entries[h]
                dropped += 1
        return dropped

    def apply_digest(
        self, replica_id: ReplicaKey, digest: Digest, grace_s: float = 0.0
    ) -> bool:
        """Replace the believed set of `replica_id` with its own report.

        Entries routed at or after `digest.timestamp - grace_s` survive: those requests
        may still be queued and not yet in the replica's cache (the grace also absorbs
        clock skew between router and replica). Returns False, changing nothing, for a
        digest no newer than the last one applied.
        """
        if digest.block_size != self.block_size:
            raise ValueError(
                f"digest of {replica_id!r} uses block_size {digest.block_size}, "
                f"the router uses {self.block_size}"
            )
        blocks = self._blocks(replica_id)
        if digest.version <= blocks.digest_version:
            return False
        blocks.replace(digest.hashes, keep_routed_after=digest.timestamp - grace_s)
        blocks.digest_version = digest.version
        blocks.on_host = digest.host_hashes
        return True

    def on_host(self, replica_id: ReplicaKey, hashes: Sequence[int]) -> int:
        """How many of `hashes` (a matched prefix) the replica holds on its host tier only."""
        blocks = self._replicas.get(replica_id)
        return sum(h in blocks.on_host for h in hashes) if blocks else 0

    def add_replica(self, replica_id: ReplicaKey) -> None:
        self._blocks(replica_id)

    def remove_replica(self, replica_id: ReplicaKey) -> None:
        self._replicas.pop(replica_id, None)

    def replicas(self) -> list[ReplicaKey]:
        return list(self._replicas)

    def num_blocks(self, replica_id: ReplicaKey) -> int:
        blocks = self._replicas.get(replica_id)
        return len(blocks) if blocks else 0

    def holds(self, replica_id: ReplicaKey, block_hash: int) -> bool:
        blocks = self._replicas.get(replica_id)
        return blocks is not None and block_hash in blocks

    def _blocks(self, replica_id: ReplicaKey) -> ReplicaBlocks:
        blocks = self._replicas.get(replica_id)
        if blocks is None:
            blocks = self._replicas[replica_id] = ReplicaBlocks(self.max_blocks_per_replica)
        return blocks
