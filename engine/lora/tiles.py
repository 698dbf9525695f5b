"""A step's rows grouped by adapter for the segmented LoRA kernels (engine/kernels/lora.py).

Requests of one adapter are scattered through a step (a decode step of 32 requests over 4
adapters interleaves them), so the kernels do not walk requests: they walk tiles of a
permutation of the adapted rows sorted by slot (Punica's SGMV, S-LoRA). `order` lists the
adapted rows, slot by slot; a tile is up to `block_m` consecutive entries of `order` under
one slot. Each adapter's A and B are then read once per tile instead of once per request,
and rows of the base model (slot -1) are in no tile at all.

Everything lives in one int32 tensor, `order` then the tiles' slots, first and end entries
(`TilePlan.pack`), so one host-to-device copy stages a step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DECODE_BLOCK_M = 16  # rows per tile of decode steps and of short extends
LONG_BLOCK_M = 64  # rows per tile of longer extends (prefill)
LONG_ROWS = 33  # an extend step of this many rows or more tiles by LONG_BLOCK_M


def block_m_for(rows: int, is_decode: bool) -> int:
    """A step's tile height, from its kind and row count only: an extend CUDA graph captured
    for a token bucket must tile as every step it replays, and a step of up to 32 tokens
    never replays a bucket above 32 (engine/executor/graph_runner.py's token buckets hold 32)."""
    return LONG_BLOCK_M if not is_decode and rows >= LONG_ROWS else DECODE_BLOCK_M


def tile_bound(rows: int, block_m: int, num_slots: int) -> int:
    """The most tiles `rows` rows over `num_slots` adapters can make (a CUDA graph's grid)."""
    return -(-rows // block_m) + min(num_slots, rows)


@dataclass
class TilePlan:
    """One step's adapted rows in slot order, cut into tiles."""

    order: list[int]
    tiles: list[tuple[int, int, int]]  # (slot, first entry of order, end entry)
    block_m: int

    @classmethod
    def of(cls, slots: list[int], lens: list[int], block_m: int) -> TilePlan:
        """`slots[i]` serves segment i, its `lens[i]` rows following segment i-1's."""
        by_slot: dict[int, list[range]] = {}
        at = 0
        for slot, n in zip(slots, lens):
            if slot >= 0 and n > 0:
                by_slot.setdefault(slot, []).append(range(at, at + n))
            at += n
        order: list[int] = []
        tiles = []
        for slot in sorted(by_slot):
            first = len(order)
            for rows in by_slot[slot]:
                order.extend(rows)
            tiles += [(slot, t, min(t + block_m, len(order)))
                      for t in range(first, len(order), block_m)]
        return cls(order, tiles, block_m)

    def pack(self, rows_cap: int, tiles_cap: int) -> torch.Tensor:
        """[rows_cap + 3 * tiles_cap] int32 on the host: order (zero-padded), then the
        tiles' slots (-1-padded: such tiles are skipped), first and end entries."""
        assert len(self.order) <= rows_cap and len(self.tiles) <= tiles_cap
        out = torch.zeros(rows_cap + 3 * tiles_cap, dtype=torch.int32)
        out[:len(self.order)] = torch.tensor(self.order, dtype=torch.int32)
        meta = out[rows_cap:].view(3, tiles_cap)
        meta[0] = -1
        if self.tiles:
            meta[:, :len(self.tiles)] = torch.tensor(self.tiles, dtype=torch.int32).T
        return out


def split_packed(packed: torch.Tensor, rows_cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [rows_cap], tiles [3, tiles_cap]) views of a packed plan."""
    return packed[:rows_cap], packed[rows_cap:].view(3, -1)
