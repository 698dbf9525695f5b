"""The replica's side of prefix routing: the block hashes its radix cache really holds.

`CacheDigest` consumes the engine's radix-cache events (`engine.core.radix_cache.CacheEvent`,
matched structurally by `CacheEventLike` so this module does not import the engine) and
keeps the set of chained block hashes (see `router.hashing.block_hashes`) of every
full block the cache holds. `encode()` turns it into compact bytes that the replica
publishes through Serve's `record_routing_stats`; the router `decode`s them and replaces
its guess of that replica's cache with the truth.

Event semantics: `tokens` is the path from the tree root to the end of the node that
appeared or disappeared, and the node covers `tokens[start:]`.
- insert: every full block of `tokens` is held (blocks before `start` belonged to
  ancestors already; re-adding them marks them recently used).
- evict: blocks whose *end* lies in `(start, len(tokens)]` are gone. A block straddling
  `start` ends inside the evicted node, so it goes too; blocks ending at or before `start`
  are still held by the ancestors. Each block hash belongs to exactly one node (the one
  holding its last token): siblings differ at their first token, so their straddling
  blocks hash differently, and no reference counting is needed.
- to_host / to_device (a host KV tier): the node's blocks (as for evict) now live on the
  host only / are back on the device; an insert puts a node's blocks on the device.

Wire format (msgpack map; hashes little-endian uint64, oldest first so the router can
keep the replica's recency order):
    {"fmt": 1, "bs": block_size, "ver": version, "ts": unix time, "h": bytes,
     "host": bytes}   # (optional) those of "h" held on the host tier only
"""
from __future__ import annotations

import sys
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import msgpack

from router.hashing import DEFAULT_BLOCK_SIZE, block_hashes

FORMAT_VERSION = 1
# 16k hashes = 128 KiB per digest; at B=16 that covers 256k cached tokens. The digest
# rides on Serve's routing-stats broadcast, so keep it modest; raise it for large caches.
DEFAULT_MAX_HASHES = 1 << 14


class CacheEventLike(Protocol):
    """Any object shaped like `engine.core.radix_cache.CacheEvent`."""

    @property
    def kind(self) -> str: ...  # "insert" | "evict" | "to_host" | "to_device"

    @property
    def tokens(self) -> Sequence[int]: ...

    @property
    def start(self) -> int: ...


@dataclass(frozen=True)
class Digest:
    """A decoded snapshot of one replica's cached blocks."""

    block_size: int
    version: int  # increases with every encode() of one CacheDigest
    timestamp: float  # replica's time.time() at encode()
    hashes: list[int]  # oldest first
    host_hashes: frozenset[int] = frozenset()  # those held on the host tier only


class CacheDigest:
    """The set of block hashes one replica's radix cache holds, bounded by `max_hashes`
    (the least recently inserted beyond it are dropped: under-reporting is harmless).

    Thread-safe: the engine's step loop feeds events from its own thread while Serve calls
    `record_routing_stats` (and so `encode`) on the replica's event loop.
    """

    def __init__(
        self,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_hashes: int = DEFAULT_MAX_HASHES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if block_size <= 0 or max_hashes <= 0:
            raise ValueError("block_size and max_hashes must be positive")
        self.block_size = block_size
        self.max_hashes = max_hashes
        self._clock = clock
        self._hashes: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._host: set[int] = set()  # of those, the blocks on the host tier only
        self._version = 0
        self._lock = threading.Lock()

    # -- events -------------------------------------------------------------------------

    def apply(self, event: CacheEventLike) -> None:
        if event.kind == "insert":
            self.insert(event.tokens)
        elif event.kind == "evict":
            self.evict(event.tokens, event.start)
        elif event.kind in ("to_host", "to_device"):
            self.move(event.tokens, event.start, to_host=event.kind == "to_host")
        else:
            raise ValueError(f"unknown cache event kind {event.kind!r}")

    def apply_all(self, events: Sequence[CacheEventLike]) -> None:
        for event in events:
            self.apply(event)

    def insert(self, tokens: Sequence[int]) -> None:
        hashes = block_hashes(tokens, self.block_size)
        with self._lock:
            self._host.difference_update(hashes)  # (a new node is on the device)
            # Root block last, so it is the newest: trimming drops leaves first and never
            # cuts a chain at its head.
            for h in reversed(hashes):
                self._hashes.pop(h, None)
                self._hashes[h] = None
            while len(self._hashes) > self.max_hashes:
                self._host.discard(self._hashes.popitem(last=False)[0])

    def evict(self, tokens: Sequence[int], start: int) -> None:
        # Block i ends at (i + 1) * B; it ends inside the node iff start < (i+1)*B <= len,
        # i.e. start // B <= i < len // B. The chain needs all earlier blocks hashed too.
        hashes = block_hashes(tokens, self.block_size)
        first = max(start, 0) // self.block_size
        with self._lock:
            for h in hashes[first:]:
                self._hashes.pop(h, None)
                self._host.discard(h)

    def move(self, tokens: Sequence[int], start: int, to_host: bool) -> None:
        """The node's blocks (those `evict` would drop) went to the host tier, or back."""
        hashes = block_hashes(tokens, self.block_size)[max(start, 0) // self.block_size:]
        with self._lock:
            if to_host:
                self._host.update(h for h in hashes if h in self._hashes)
            else:
                self._host.difference_update(hashes)

    def clear(self) -> None:
        with self._lock:
            self._hashes.clear()
            self._host.clear()

    # -- queries ------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, h: object) -> bool:
        return h in self._hashes

    def hashes(self) -> list[int]:
        """Held block hashes, oldest first."""
        with self._lock:
            return list(self._hashes)

    # -- wire format --------------------------------------------------------------------

    def encode(self) -> bytes:
        """A snapshot as compact bytes (8 bytes per block plus a small header). Each call
        gets a new, larger version so the router can drop out-of-order copies."""
        with self._lock:
            packed = array("Q", self._hashes)
            host = array("Q", (h for h in self._host if h in self._hashes))
            self._version += 1
            version = self._version
        if sys.byteorder == "big":
            packed.byteswap()
            host.byteswap()
        return msgpack.packb(
            {
                "fmt": FORMAT_VERSION,
                "bs": self.block_size,
                "ver": version,
                "ts": self._clock(),
                "h": packed.tobytes(),
                "host": host.tobytes(),
            },
            use_bin_type=True,
        )

    @staticmethod
    def decode(data: bytes) -> Digest:
        return decode_digest(data)


def decode_digest(data: bytes) -> Digest:
    """Parse `CacheDigest.encode()` output; raises ValueError on anything malformed."""
    try:
        obj = msgpack.unpackb(data, raw=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise ValueError(f"cache digest is not valid msgpack: {e}") from e
    if not isinstance(obj, dict) or obj.get("fmt") != FORMAT_VERSION:
        raise ValueError("cache digest has an unknown format")
    block_size, version, ts, raw = obj.get("bs"), obj.get("ver"), obj.get("ts"), obj.get("h")
    if not (isinstance(block_size, int) and block_size > 0 and isinstance(version, int)
            and isinstance(ts, (int, float)) and isinstance(raw, bytes)):
        raise ValueError("cache digest has missing or mistyped fields")
    host_raw = obj.get("host", b"")
    if not isinstance(host_raw, bytes):
        raise ValueError("cache digest has missing or mistyped fields")
    return Digest(block_size=block_size, version=version, timestamp=float(ts),
                  hashes=_uint64s(raw), host_hashes=frozenset(_uint64s(host_raw)))


def _uint64s(raw: bytes) -> list[int]:
    if len(raw) % 8:
        raise ValueError("cache digest hash payload is not a whole number of uint64s")
    out = array("Q")
    out.frombytes(raw)
    if sys.byteorder == "big":
        out.byteswap()
    return out.tolist()
