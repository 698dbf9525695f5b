"""RadixCache: the KV of all requests in one radix tree over token ids (page size 1).

Each node holds a run of tokens (`key`) and the KV slots of those tokens (`value`). A
request locks the node its cached prefix ends at, which protects the whole path to the
root; unlocked leaves are evicted least-recently-used first when the pool runs short.
Inserts and evictions are recorded as `CacheEvent`s so a router can learn what this
replica really holds.

Keys and values are tuples, not lists: a tuple of ints leaves the garbage collector's view
after one collection, a list never does, and a full tree (the whole KV pool, ~1M tokens on
an H200) held as lists made every full collection walk two million items (engine/runtime/gc_freeze.py).
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from engine.core.slot_allocator import SlotAllocator


@dataclass(frozen=True)
class CacheEvent:
    """A node appeared or disappeared. `tokens` is the full path from the root to the
    node's end; the node itself covers `tokens[start:]`."""

    kind: Literal["insert", "evict"]
    tokens: tuple[int, ...]
    start: int


_clock = itertools.count()

# Prefixes computed under a LoRA adapter live in their own part of the tree: their tokens
# are keyed as `namespace * _NAMESPACE_STRIDE + token` (token ids are below 2**32), so a
# prefix under one adapter never matches another adapter's or the base model's.
_NAMESPACE_STRIDE = 1 << 32


def _keyed(tokens: Sequence[int], namespace: int) -> Sequence[int]:
    if not namespace:
        return tokens
    offset = namespace * _NAMESPACE_STRIDE
    return [offset + t for t in tokens]


@dataclass(eq=False)
class TreeNode:
    key: tuple[int, ...] = ()
    value: tuple[int, ...] = ()
    parent: TreeNode | None = None
    children: dict[int, TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = field(default_factory=lambda: next(_clock))

    def touch(self) -> None:
        self.last_access = next(_clock)

    def path_tokens(self) -> tuple[int, ...]:
        parts, node = [], self
        while node is not None:
            parts.append(node.key)
            node = node.parent
        return tuple(t for part in reversed(parts) for t in part)


def _common_len(a: tuple[int, ...], b: Sequence[int], start: int) -> int:
    """Length of the common run of the key a and b[start:]."""
    n = min(len(a), len(b) - start)
    i = 0
    # Compare in chunks: slice equality runs in C, far faster than a token loop (a tuple
    # equals only a tuple; tuple() of a tuple's slice copies nothing).
    step = 64
    while i + step <= n and a[i:i + step] == tuple(b[start + i:start + i + step]):
        i += step
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class RadixCache:
    def __init__(self, allocator: SlotAllocator, enabled: bool = True,
                 record_events: bool = False) -> None:
        self.allocator = allocator
        self.enabled = enabled
        self.record_events = record_events
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_size = 0  # tokens in unlocked nodes
        self.protected_size = 0  # tokens in locked nodes
        self.events: list[CacheEvent] = []

    # -- lookup -------------------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int], namespace: int = 0) -> tuple[list[int], TreeNode]:
        """Slots of the longest cached prefix of `tokens` (under the LoRA adapter
        `namespace`, 0 for the base), and the node it ends at.

        A match ending inside a node splits it, so the returned node covers exactly the
        matched prefix and can be locked.
        """
        if not self.enabled:
            return [], self.root
        tokens = _keyed(tokens, namespace)
        node, pos, slots = self.root, 0, []
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common_len(child.key, tokens, pos)
            child.touch()
            if n < len(child.key):
                child = self._split(child, n)
            slots.extend(child.value)
            pos += n
            node = child
        return slots, node

    def match_len(self, tokens: Sequence[int], namespace: int = 0) -> int:
        """Length of the longest cached prefix of `tokens`, read only: nothing is touched or
        split (the lpm admission order asks it of every waiting request, every step)."""
        if not self.enabled:
            return 0
        tokens = _keyed(tokens, namespace)
        node, pos = self.root, 0
        while pos < len(tokens) and (child := node.children.get(tokens[pos])) is not None:
            n = _common_len(child.key, tokens, pos)
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Cut `node` after n tokens; returns the new upper part."""
        upper = TreeNode(key=node.key[:n], value=node.value[:n], parent=node.parent,
                         lock_ref=node.lock_ref, last_access=node.last_access)
        upper.children = {node.key[n]: node}
        node.parent.children[upper.key[0]] = upper
        node.key, node.value, node.parent = node.key[n:], node.value[n:], upper
        return upper

    # -- insert -------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], slots: Sequence[int], namespace: int = 0) -> int:
        """Insert tokens with their KV slots; returns how many leading tokens were already
        cached. The caller owns (and must free) its slots for those leading tokens, since
        the tree keeps its own copy."""
        assert len(tokens) == len(slots)
        if not self.enabled:
            return 0
        tokens = _keyed(tokens, namespace)
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                new = TreeNode(key=tuple(tokens[pos:]), value=tuple(slots[pos:]), parent=node)
                node.children[tokens[pos]] = new
                self.evictable_size += len(new.key)
                self._record("insert", new)
                return pos
            n = _common_len(child.key, tokens, pos)
            child.touch()
            if n < len(child.key):
                child = self._split(child, n)
            pos += n
            node = child
        return pos

    # -- locking ------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unlock of an unlocked node"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node = node.parent

    # -- eviction -----------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots from unlocked leaves, oldest first (or as many
        as possible). Returns the number freed."""
        if num_tokens <= 0 or self.evictable_size == 0:
            return 0
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            self.allocator.free(leaf.value)
            freed += len(leaf.value)
            self.evictable_size -= len(leaf.key)
            self._record("evict", leaf)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _leaves(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root:
                out.append(node)
            stack.extend(node.children.values())
        return out

    # -- events and stats ---------------------------------------------------------------

    def _record(self, kind: Literal["insert", "evict"], node: TreeNode) -> None:
        # (adapters' prefixes stay out of the routing digest, which hashes base tokens)
        if self.record_events and node.key[0] < _NAMESPACE_STRIDE:
            tokens = node.path_tokens()
            self.events.append(CacheEvent(kind, tokens, len(tokens) - len(node.key)))

    def drain_events(self) -> list[CacheEvent]:
        events, self.events = self.events, []
        return events

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def all_slots(self) -> list[int]:
        """Every slot the tree holds (for leak checks)."""
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.extend(node.value)
            stack.extend(node.children.values())
        return out

    def reset(self) -> None:
        """Drop every unlocked node (flush the cache)."""
        self.evict(self.evictable_size)
