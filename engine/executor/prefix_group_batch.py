"""The device side of radix-grouped decode (engine/core/prefix_groups.py plans the groups):
one decode step's groups as one int64 tensor, and views of it.

Device metadata (one int64 tensor, laid out for a capacity `cap` >= batch size, so a CUDA
graph captured for a padded batch of `cap` reads it at fixed addresses):

    [0] num_tiles   [1] num_splits (prefix splits P)
    then six arrays of `cap` entries:
    pfx_len[b]      prefix length of batch entry b (0: not grouped, attends alone)
    tile_row[t]     req_to_token row holding the prefix slots (any member's row)
    tile_len[t]     prefix length L of tile t
    tile_mstart[t]  first member of tile t in `members`
    tile_mcount[t]  members of tile t (<= members_per_tile)
    members[i]      batch indices, tile by tile

A tile is up to `members_per_tile` members of one group (a big group gets several tiles,
each reading the prefix once); the prefix kernel loads a KV block once per tile and KV
head and multiplies it by all the tile's members' query heads of that KV head.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.core.prefix_groups import GroupPlan

CTRL = 2  # leading control entries of the packed metadata
FIELDS = 6  # arrays of `cap` entries after them


def packed_len(cap: int) -> int:
    return CTRL + FIELDS * cap


@dataclass
class PrefixGroupBatch:
    """Device views of the packed metadata, plus host-side sizes for launch decisions."""

    packed: torch.Tensor  # [packed_len(cap)] int64
    cap: int
    num_tiles: int  # host copy (eager launches size their grid with it; graphs use cap)
    num_splits: int
    max_suffix: int

    @property
    def ctrl(self) -> torch.Tensor:
        return self.packed[:CTRL]

    def field(self, i: int) -> torch.Tensor:
        start = CTRL + i * self.cap
        return self.packed[start:start + self.cap]

    @property
    def pfx_len(self) -> torch.Tensor:
        return self.field(0)

    @property
    def tile_row(self) -> torch.Tensor:
        return self.field(1)

    @property
    def tile_len(self) -> torch.Tensor:
        return self.field(2)

    @property
    def tile_mstart(self) -> torch.Tensor:
        return self.field(3)

    @property
    def tile_mcount(self) -> torch.Tensor:
        return self.field(4)

    @property
    def members(self) -> torch.Tensor:
        return self.field(5)

    @classmethod
    def from_plan(cls, packed: torch.Tensor, plan: GroupPlan) -> "PrefixGroupBatch":
        return cls(packed=packed, cap=plan.cap, num_tiles=len(plan.tiles),
                   num_splits=plan.num_splits, max_suffix=plan.max_suffix)

    @classmethod
    def from_packed(cls, packed: torch.Tensor, host: torch.Tensor,
                    seq_lens: list[int]) -> "PrefixGroupBatch":
        """From the uploaded metadata and its host copy (`GroupPlan.packed()` as an int64
        CPU tensor): what a tensor-parallel rank that did not plan the step gets."""
        cap = (host.numel() - CTRL) // FIELDS
        head = host[:CTRL + len(seq_lens)].tolist()
        pfx = head[CTRL:]
        return cls(packed=packed, cap=cap, num_tiles=head[0], num_splits=head[1],
                   max_suffix=max((s - p for s, p in zip(seq_lens, pfx)), default=1))
