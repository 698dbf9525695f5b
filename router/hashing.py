"""Chained block hashes of token ids: the one name a token prefix has on both sides of
prefix routing (the replica's `CacheDigest` and the router's `PrefixIndex`).

A prompt's token ids are cut into blocks of `block_size` tokens; block i's hash is
computed over block i-1's hash plus block i's tokens, so one hash names the whole prefix
up to the end of that block.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

DEFAULT_BLOCK_SIZE = 16

# The chain starts from a fixed 8-byte seed, so the first block is hashed like any other.
_ROOT = bytes(8)


def block_hashes(token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE) -> list[int]:
    """Chained 64-bit hashes of the full blocks of `token_ids` (a trailing partial block
    is ignored: it cannot be shared at block granularity).

    blake2b with an explicit little-endian packing makes the values identical across
    processes, machines and Python runs, unlike the salted built-in `hash()`; replicas
    and routers compare them.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_blocks = len(token_ids) // block_size
    if n_blocks == 0:
        return []
    n_tokens = n_blocks * block_size
    # Pack all tokens once (C speed), then hash fixed-width slices of the buffer.
    packed = struct.pack(f"<{n_tokens}i", *token_ids[:n_tokens])
    stride = 4 * block_size
    out: list[int] = []
    prev = _ROOT
    for i in range(n_blocks):
        h = hashlib.blake2b(prev, digest_size=8)
        h.update(packed[i * stride:(i + 1) * stride])
        prev = h.digest()
        out.append(int.from_bytes(prev, "little"))
    return out
