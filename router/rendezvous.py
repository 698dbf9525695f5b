"""Rendezvous (highest-random-weight) hashing: every router instance ranks the engine
replicas for a prefix identically, from the prefix and the replicas' ids alone.

A prefix's key is the chained hash of its leading blocks (`router.hashing`); each replica
scores `blake2b(key, replica id)` and the ranking is by score, highest first. Nothing else
goes in, so ingress replicas that have seen different traffic, or none, agree without
talking to each other, and a replica that joins or leaves changes the first place only of
the prefixes it wins or held (the others' scores are untouched).
"""
from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterable, Sequence

# Requests shorter than one block, or without token ids, have no prefix to keep together:
# they are ranked by a key of their own (e.g. the request id), which spreads them.
DEFAULT_KEY_BLOCKS = 4


def prefix_key(hashes: Sequence[int], key_blocks: int = DEFAULT_KEY_BLOCKS) -> int | None:
    """The hash naming the prompt's first `key_blocks` blocks (fewer when the prompt is
    shorter), or None for a prompt without a full block.

    The depth trades two things: requests that share fewer leading blocks than this get
    different keys (their short common prefix is cached wherever they land; the digest
    correction in `router.policy` still finds it), and prompts that share at least this many
    blocks (say a long system prompt) get one key, and spread by bounded load.
    """
    if key_blocks <= 0:
        raise ValueError(f"key_blocks must be positive, got {key_blocks}")
    if not hashes:
        return None
    return hashes[min(len(hashes), key_blocks) - 1]


def score(key: int, replica_id: str) -> int:
    h = hashlib.blake2b(key.to_bytes(8, "little", signed=False), digest_size=8)
    h.update(replica_id.encode())
    return int.from_bytes(h.digest(), "little")


def text_key(text: str) -> int:
    """A 64-bit key for a string (a request id): ranks requests that have no prefix."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def rank(key: int, replicas: Iterable[Hashable], name=str) -> list[Hashable]:
    """`replicas` in the key's order, best first. `name(replica)` is its stable id (a
    string every router instance sees the same); ties, which need equal 64-bit scores,
    fall back to the name so the order is total."""
    return sorted(replicas, key=lambda r: (score(key, name(r)), name(r)), reverse=True)
