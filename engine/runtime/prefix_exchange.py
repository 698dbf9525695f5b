"""Prefixes between replicas: one engine exports a cached prefix's KV (through its host
tier, written back first where only the GPU holds it) and another imports it into its own
host tier, so its next request with that prefix loads it instead of computing it.

The importer says how much of the prompt it holds already (`cached_length`, in either
tier), and the exporter sends only the rows past that (`skip`): a receiver that lacks only
a conversation's last turn receives that turn's KV, not the whole history again.

The serving layer carries the exported rows between replicas (through Ray's object
store); an import that cannot be used (another model or dtype, a tier too small) changes
nothing, and the request then computes the prefix as it would have anyway.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from engine.core.prefix_rows import PrefixRows
    from engine.core.tree_node import TreeNode


# What the exchange uses of the engine's radix cache and host tier (engine/core/radix_cache.py,
# host_tier.py), which the engine hands in.

class PrefixCache(Protocol):
    enabled: bool
    root: TreeNode

    def cached_path(self, tokens: Sequence[int]) -> list[TreeNode]: ...


class PrefixTier(Protocol):
    def export(self, path: list[TreeNode], skip: int = 0) -> tuple[int, Any]: ...

    def import_(self, parent: TreeNode, key: tuple[int, ...], rows: Any, start: int) -> int: ...


@dataclass
class ExportedPrefix:
    tokens: list[int]  # the prefix
    rows: PrefixRows  # the KV of tokens[start:] (one row per token)
    start: int = 0  # the tokens the importer said it held, whose rows stay home


def cached_length(cache: PrefixCache, tokens: Sequence[int]) -> int:
    """The tokens of `tokens`' longest cached prefix, in either tier (touched: a request
    is about to use them)."""
    return sum(len(node.key) for node in cache.cached_path(tokens)) if cache.enabled else 0


def export_prefix(cache: PrefixCache, tier: PrefixTier | None, tokens: Sequence[int],
                  skip: int = 0) -> ExportedPrefix | None:
    """The longest cached prefix of `tokens`, with the KV of its tokens past the first
    `skip`; None (no tier, nothing cached past `skip`)."""
    if tier is None or not cache.enabled:
        return None
    path = cache.cached_path(tokens)
    before, first = 0, 0  # tokens of the nodes wholly within `skip`, and their count
    while first < len(path) and before + len(path[first].key) <= skip:
        before += len(path[first].key)
        first += 1
    if first == len(path):
        return None
    n, rows = tier.export(path[first:], skip - before)
    end = before + n
    return ExportedPrefix(list(tokens[:end]), rows, start=skip) if end > skip else None


def import_prefix(cache: PrefixCache, tier: PrefixTier | None, prefix: ExportedPrefix) -> int:
    """Put the part of `prefix` this cache lacks into the host tier; returns the tokens
    added (0: already cached, no room, or this cache no longer holds the tokens the rows
    start after). ValueError for rows of another shape."""
    if tier is None or not cache.enabled or not prefix.tokens:
        return 0
    path = cache.cached_path(prefix.tokens)
    have = sum(len(node.key) for node in path)
    if have >= len(prefix.tokens) or have < prefix.start:
        return 0
    parent = path[-1] if path else cache.root
    return tier.import_(parent, tuple(prefix.tokens[have:]), prefix.rows, have - prefix.start)
