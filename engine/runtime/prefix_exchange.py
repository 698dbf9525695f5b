"""Prefixes between replicas: one engine exports a cached prefix's KV (through its host
tier, written back first where only the GPU holds it) and another imports it into its own
host tier, so its next request with that prefix loads it instead of computing it.

The serving layer carries the exported rows between replicas (through Ray's object
store); an import that cannot be used (another model or dtype, a tier too small) changes
nothing, and the request then computes the prefix as it would have anyway.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine hands in its cache and tier; the clients carry the type
    from engine.core.host_tier import HostTier
    from engine.core.radix_cache import RadixCache
    from engine.executor.kv_transfer import PrefixRows


@dataclass
class ExportedPrefix:
    tokens: list[int]  # the prefix whose KV `rows` hold (one row per token)
    rows: PrefixRows


def export_prefix(cache: RadixCache, tier: HostTier | None,
                  tokens: Sequence[int]) -> ExportedPrefix | None:
    """The longest cached prefix of `tokens` with its KV, or None (no tier, nothing cached)."""
    if tier is None or not cache.enabled:
        return None
    path = cache.cached_path(tokens)
    if not path:
        return None
    n, rows = tier.export(path)
    return ExportedPrefix(list(tokens[:n]), rows) if n else None


def import_prefix(cache: RadixCache, tier: HostTier | None, prefix: ExportedPrefix) -> int:
    """Put the part of `prefix` this cache lacks into the host tier; returns the tokens
    added (0: already cached, or no room). ValueError for rows of another shape."""
    if tier is None or not cache.enabled or not prefix.tokens:
        return 0
    path = cache.cached_path(prefix.tokens)
    have = sum(len(node.key) for node in path)
    if have >= len(prefix.tokens):
        return 0
    parent = path[-1] if path else cache.root
    return tier.import_(parent, tuple(prefix.tokens[have:]), prefix.rows, have)
