"""RadixCache: the KV of all requests in one radix tree over token ids (page size 1).

Each node holds a run of tokens (`key`) and the KV slots of those tokens (`value`). A
request locks the node its cached prefix ends at, which protects the whole path to the
root; unlocked leaves are evicted least-recently-used first when the pool runs short.
Inserts and evictions are recorded as `CacheEvent`s so a router can learn what this
replica really holds; with a host tier, in either tier, and which: a node moving to the
host is a "to_host" event, one loaded back a "to_device" one.

With a host tier (`host`, engine/core/host_tier.py) an evicted node stays in the tree with
its KV on the host (`value` empty, `host_value` set) and `load_back` brings it back before a
prefill needs it. Device nodes always form the upper part of the tree: a node leaves the
device only once its children have, and loads go from the top down.

Keys and values are tuples, not lists: a tuple of ints leaves the garbage collector's view
after one collection, a list never does, and a full tree (the whole KV pool, ~1M tokens on
an H200) held as lists made every full collection walk two million items (engine/runtime/gc_freeze.py).
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from engine.core.slot_allocator import SlotAllocator
from engine.core.tree_node import TreeNode


# A node appeared, disappeared, or (with a host tier) moved between the tiers.
EventKind = Literal["insert", "evict", "to_host", "to_device"]


@dataclass(frozen=True)
class CacheEvent:
    """A node appeared or disappeared. `tokens` is the full path from the root to the
    node's end; the node itself covers `tokens[start:]`."""

    kind: EventKind
    tokens: tuple[int, ...]
    start: int


# Prefixes computed under a LoRA adapter live in their own part of the tree: their tokens
# are keyed as `namespace * _NAMESPACE_STRIDE + token` (token ids are below 2**32), so a
# prefix under one adapter never matches another adapter's or the base model's.
_NAMESPACE_STRIDE = 1 << 32


def _keyed(tokens: Sequence[int], namespace: int) -> Sequence[int]:
    if not namespace:
        return tokens
    offset = namespace * _NAMESPACE_STRIDE
    return [offset + t for t in tokens]


def _is_device_leaf(node: TreeNode) -> bool:
    """On the device, with no child there (without a host tier: a leaf)."""
    return bool(node.value) and not any(c.value for c in node.children.values())


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


class HostStore(Protocol):
    """The host tier as the tree uses it (engine/core/host_tier.py)."""

    eager: bool

    def attach(self, root: TreeNode, record: Callable[[str, TreeNode], None]) -> None: ...
    def keep(self, node: TreeNode) -> bool: ...  # give it a host copy; False: no room
    def load(self, node: TreeNode, slots: list[int]) -> None: ...
    def release(self, node: TreeNode) -> None: ...  # free the host copies of its subtree


class RadixCache:
    def __init__(self, allocator: SlotAllocator, enabled: bool = True,
                 record_events: bool = False, host: HostStore | None = None) -> None:
        self.allocator = allocator
        self.enabled = enabled
        self.record_events = record_events
        self.host = host
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_size = 0  # tokens in unlocked nodes
        self.protected_size = 0  # tokens in locked nodes
        self.events: list[CacheEvent] = []
        if host is not None:
            host.attach(self.root, self._record)

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
            if child is None or not child.value:  # (on the host only: `load_back` first)
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
        while pos < len(tokens) and (child := node.children.get(tokens[pos])) is not None \
                and child.value:
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
        if node.host_value is not None:
            upper.host_value, node.host_value = node.host_value[:n], node.host_value[n:]
        return upper

    # -- insert -------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], slots: Sequence[int], namespace: int = 0) -> int:
        """Insert tokens with their KV slots; returns how many leading tokens were already
        cached. The caller owns (and must free) its slots for those leading tokens, since
        the tree keeps its own copy. Nodes held on the host only take the caller's slots
        as their device copy, so the count stops before the first of them."""
        assert len(tokens) == len(slots)
        if not self.enabled:
            return 0
        tokens = _keyed(tokens, namespace)
        node, pos, adopted_from = self.root, 0, None
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                new = TreeNode(key=tuple(tokens[pos:]), value=tuple(slots[pos:]), parent=node)
                node.children[tokens[pos]] = new
                self._added_to_device(new)
                return pos if adopted_from is None else adopted_from
            n = _common_len(child.key, tokens, pos)
            child.touch()
            if n < len(child.key):
                child = self._split(child, n)
            if not child.value:
                child.value = tuple(slots[pos:pos + n])
                self._added_to_device(child)
                adopted_from = pos if adopted_from is None else adopted_from
            pos += n
            node = child
        return pos if adopted_from is None else adopted_from

    def _added_to_device(self, node: TreeNode) -> None:
        self.evictable_size += len(node.key)
        self._record("insert", node)
        if self.host is not None and self.host.eager:
            self.host.keep(node)

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

    def evict(self, num_tokens: int, to_host: bool = True) -> int:
        """Free at least `num_tokens` device slots from unlocked nodes without device
        children, oldest first (or as many as possible); with a host tier (and `to_host`)
        they stay in the tree on the host. Returns the number freed."""
        if num_tokens <= 0 or self.evictable_size == 0:
            return 0
        heap = [(n.last_access, id(n), n) for n in self._device_leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            self.evictable_size -= len(leaf.key)
            kept = to_host and self.host is not None and self.host.keep(leaf)
            self.allocator.free(leaf.value)  # (a write-back is queued before any reuse)
            freed += len(leaf.value)
            leaf.value = ()
            parent = leaf.parent
            if not kept:
                self.remove(leaf)
            else:
                self._record("to_host", leaf)
            if parent is not self.root and parent.lock_ref == 0 and _is_device_leaf(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def remove(self, node: TreeNode) -> None:
        """Take a node off the device (or with none there) out of the tree, with its
        subtree (host-only nodes)."""
        if self.record_events:
            stack = [node]
            while stack:
                n = stack.pop()
                self._record("evict", n)
                stack.extend(n.children.values())
        del node.parent.children[node.key[0]]
        if self.host is not None:
            self.host.release(node)

    def _device_leaves(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root and _is_device_leaf(node):
                out.append(node)
            stack.extend(c for c in node.children.values() if c.value)
        return out

    # -- host tier ----------------------------------------------------------------------

    def load_back(self, tokens: Sequence[int], free_only: bool = False,
                  namespace: int = 0) -> int:
        """Bring the host-held part of `tokens`' cached prefix (under `namespace`) back to
        the device, top down, while memory allows (`free_only`: into free slots alone,
        evicting nothing: a prefetch). Returns the tokens loaded; `match_prefix` then finds
        them."""
        chain = self._host_chain(_keyed(tokens, namespace))
        if not chain:
            return 0
        anchor, loaded = chain[0].parent, 0
        self.lock(anchor)  # the device path above stays put while others are evicted
        for node in chain:
            n = len(node.key)
            room = self.allocator.num_free + (0 if free_only else self.evictable_size)
            if room < n:
                break
            if self.allocator.num_free < n:
                self.evict(n - self.allocator.num_free)
            if node.host_value is None or self.allocator.num_free < n:
                break  # (its write-backs pushed it out of a full host tier)
            slots = self.allocator.alloc(n)
            self.host.load(node, slots)
            node.value = tuple(slots)
            self._record("to_device", node)
            self._added_to_device(node)
            self.lock(node)
            self.unlock(anchor)
            anchor, loaded = node, loaded + n
        self.unlock(anchor)
        return loaded

    def _host_chain(self, tokens: Sequence[int]) -> list[TreeNode]:
        """The host-only nodes along `tokens`' cached prefix (the last one cut to it)."""
        if self.host is None or not self.enabled:
            return []
        return [node for node in self.cached_path(tokens) if not node.value]

    def cached_path(self, tokens: Sequence[int]) -> list[TreeNode]:
        """The nodes of `tokens`' longest cached prefix in either tier, top down, the last
        one cut to where the prefix ends (touched: they are in use)."""
        node, pos, path = self.root, 0, []
        while pos < len(tokens) and (child := node.children.get(tokens[pos])) is not None:
            n = _common_len(child.key, tokens, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.touch()
            path.append(child)
            pos, node = pos + n, child
        return path

    # -- events and stats ---------------------------------------------------------------

    def _record(self, kind: EventKind, node: TreeNode) -> None:
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

    def all_host_slots(self) -> list[int]:
        """Every host-tier slot the tree holds (for leak checks)."""
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.extend(node.host_value or ())
            stack.extend(node.children.values())
        return out

    def reset(self) -> None:
        """Drop every unlocked node (flush the cache), on the host too."""
        self.evict(self.evictable_size, to_host=False)
        stack, host_only = [self.root], []
        while stack:
            node = stack.pop()
            for child in node.children.values():
                (stack if child.value else host_only).append(child)
        for node in host_only:
            self.remove(node)
