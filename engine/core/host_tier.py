"""The host tier under the radix cache: which host-memory slots hold which tree node's KV,
and which host copies go first when the tier is full.

The radix tree (engine/core/radix_cache.py) decides when a node moves: eviction keeps a
node on the host (`keep`), a request that needs it loads it back (`load`). This module
owns the host slots (a `SlotAllocator` of its own, so the tier never holds more than its
size) and asks the `KVMover` (engine/executor/kv_transfer.py) to copy the bytes.

One LRU spans both tiers: every node carries one `last_access`. The device evicts its
least recently used nodes to the host; the host drops its least recently used copies:
a node also on the device just loses its host copy, a node on the host alone leaves the
tree (only once its children have, so a path never has a hole).

Write-back is "lazy" (a node is copied when the device evicts it) or "eager" (when it
enters the tree, so eviction later only frees slots); either way the copy is queued on
the mover's own stream and no step waits for it on the host.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine.core.tree_node import TreeNode
from engine.core.slot_allocator import SlotAllocator


class KVMover(Protocol):
    """Copies KV rows between the device pool and the host pool (slot ids of each)."""

    def write_back(self, device_slots: Sequence[int], host_slots: Sequence[int]) -> None: ...

    def load(self, host_slots: Sequence[int], device_slots: Sequence[int]) -> None: ...

    def read(self, host_slots: Sequence[int]) -> Any: ...  # the rows, once copies are done

    def write(self, host_slots: Sequence[int], rows: Any, start: int) -> None: ...


@dataclass
class HostTierStats:
    written_tokens: int = 0  # device -> host
    loaded_tokens: int = 0  # host -> device
    dropped_tokens: int = 0  # host copies dropped to make room
    refused_tokens: int = 0  # evicted nodes the tier could not take (dropped outright)
    exported_tokens: int = 0  # prefixes read out for another replica
    imported_tokens: int = 0  # prefixes taken in from another replica


class HostTier:
    def __init__(self, num_slots: int, mover: KVMover, eager: bool = False) -> None:
        self.allocator = SlotAllocator(num_slots)
        self.mover = mover
        self.eager = eager
        self.root: TreeNode | None = None  # the tree's root, set by `attach`
        self.record: Callable[[str, TreeNode], None] = lambda kind, node: None
        self.stats = HostTierStats()

    def attach(self, root: TreeNode, record: Callable[[str, TreeNode], None]) -> None:
        """Serve the tree under `root`; `record("insert" | "evict" | "to_host", node)` as
        nodes enter or leave it here (the tree's cache events)."""
        self.root, self.record = root, record

    @property
    def num_slots(self) -> int:
        return self.allocator.num_slots

    @property
    def used_slots(self) -> int:
        return self.allocator.num_slots - self.allocator.num_free

    # -- what the tree asks -------------------------------------------------------------

    def keep(self, node: TreeNode) -> bool:
        """Make sure `node` (on the device) has a host copy; False when the tier cannot
        make room for it."""
        if node.host_value is not None:
            return True
        n = len(node.value)
        if not self._make_room(n):
            self.stats.refused_tokens += n
            return False
        slots = self.allocator.alloc(n)
        self.mover.write_back(node.value, slots)
        node.host_value = tuple(slots)
        self.stats.written_tokens += n
        return True

    def load(self, node: TreeNode, slots: list[int]) -> None:
        """Copy `node`'s host KV into the device `slots`; the host copy stays (a later
        eviction of the node frees its device slots without another copy)."""
        self.mover.load(node.host_value, slots)
        self.stats.loaded_tokens += len(slots)

    def release(self, node: TreeNode) -> None:
        """`node` left the tree: free the host copies of it and of its subtree."""
        stack = [node]
        while stack:
            n = stack.pop()
            if n.host_value is not None:
                self.allocator.free(n.host_value)
                n.host_value = None
            stack.extend(n.children.values())

    # -- prefixes between replicas ----------------------------------------------------------

    def export(self, path: list[TreeNode], skip: int = 0) -> tuple[int, Any]:
        """The KV rows of a cached path (`RadixCache.cached_path`) from its `skip`th token
        on, written back first where only the device holds them: (tokens of the path
        covered, from its start; the rows of those past `skip`), as far as the tier can hold."""
        covered = 0
        for node in path:
            if not self.keep(node):
                break
            covered += 1
        slots: list[int] = []
        for node in path[:covered]:
            if node.host_value is None:  # (making room for a later node dropped it)
                break
            slots.extend(node.host_value)
        self.stats.exported_tokens += max(0, len(slots) - skip)
        return len(slots), self.mover.read(slots[skip:])

    def import_(self, parent: TreeNode, key: tuple[int, ...], rows: Any, start: int) -> int:
        """Hang `key` (tokens whose KV is `rows[start:]`) under `parent` as a host-only
        node; returns the tokens taken (0 when the tier cannot make room)."""
        if not self._make_room(len(key)):
            return 0
        if parent is not self.root and not parent.value and parent.host_value is None:
            return 0  # making room dropped the parent itself
        slots = self.allocator.alloc(len(key))
        try:
            self.mover.write(slots, rows, start)
        except BaseException:
            self.allocator.free(slots)
            raise
        node = TreeNode(key=key, value=(), parent=parent, host_value=tuple(slots))
        parent.children[key[0]] = node
        self.record("insert", node)
        self.record("to_host", node)
        self.stats.imported_tokens += len(key)
        return len(key)

    # -- room ---------------------------------------------------------------------------

    def _make_room(self, n: int) -> bool:
        """Drop least recently used host copies until `n` slots are free. Each walk of the
        tree frees a 64th of the tier at least, so a full tier under a stream of small
        write-backs walks it once per many of them, not once each."""
        if n > self.allocator.num_slots:
            return False
        if self.allocator.num_free >= n:
            return True
        target = min(max(n, self.allocator.num_slots // 64), self.allocator.num_slots)
        heap = [(c.last_access, id(c), c) for c in self._droppable()]
        heapq.heapify(heap)
        while self.allocator.num_free < target and heap:
            _, _, node = heapq.heappop(heap)
            if node.host_value is None:
                continue
            self._drop(node)
            parent = node.parent
            if parent is not self.root and not parent.value and not parent.children:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return self.allocator.num_free >= n

    def _droppable(self) -> list[TreeNode]:
        """Host copies that can go now: of device nodes, and of host-only leaves."""
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.host_value is not None and (node.value or not node.children):
                out.append(node)
            stack.extend(node.children.values())
        return out

    def _drop(self, node: TreeNode) -> None:
        self.allocator.free(node.host_value)
        self.stats.dropped_tokens += len(node.host_value)
        node.host_value = None
        if not node.value:  # on the host alone: it leaves the tree
            self.record("evict", node)
            del node.parent.children[node.key[0]]

    # -- for leak checks ----------------------------------------------------------------

    def free_slots(self) -> list[int]:
        return self.allocator.free_slots()
