"""TreeNode: one node of the radix tree (engine/core/radix_cache.py), a run of tokens and
their KV slots. Its own module so that a request can name the node it locks without
depending on the cache."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

_clock = itertools.count()


@dataclass(eq=False)
class TreeNode:
    key: tuple[int, ...] = ()
    value: tuple[int, ...] = ()
    parent: TreeNode | None = None
    children: dict[int, TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = field(default_factory=lambda: next(_clock))
    host_value: tuple[int, ...] | None = None  # host-tier slots of the same tokens

    def touch(self) -> None:
        self.last_access = next(_clock)

    def path_tokens(self) -> tuple[int, ...]:
        parts, node = [], self
        while node is not None:
            parts.append(node.key)
            node = node.parent
        return tuple(t for part in reversed(parts) for t in part)
