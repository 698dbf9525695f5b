"""What a step's forward reads to add LoRA deltas: the step's segments (`LoRABatch`) and,
on each adaptable linear, a hook (`LoRAHook`) that adds its slots' deltas to the output.

On a GPU the hook runs the segmented Triton kernels (engine/kernels/lora.py) over the
step's rows grouped by adapter (engine/lora/tiles.py; in a CUDA graph, decode or extend,
static buffers the step writes before replay); on a CPU a torch matmul per run of rows
under one adapter.
"""
from __future__ import annotations

from typing import Protocol

import torch

from engine.lora.tiles import DECODE_BLOCK_M, TilePlan, block_m_for, split_packed, tile_bound


# What a hook reads of engine/lora/pool.py's LoRAPool and its PoolGroups (named here, so that
# this module sits below the pool, which the manager builds and hands in).

class LinearSlots(Protocol):
    """One fused linear's adapter weights in every slot (a PoolGroup)."""

    part_sizes: tuple[int, ...]
    a: torch.Tensor  # [slots, len(parts) * R, in]
    b: torch.Tensor  # [slots, out, R]

    @property
    def bounds(self) -> list[int]: ...


class SlotRanks(Protocol):
    """The pool's padded rank R and each slot's own rank (a LoRAPool)."""

    rank: int
    ranks: torch.Tensor


class LoRABatch:
    """The current step's adapter per segment (a request's new tokens; -1: the base), and
    on a GPU its rows grouped by adapter for the kernels (engine/lora/tiles.py).

    A step's plan goes to static device buffers when it fits them (`capacity` rows: the
    largest step a CUDA graph runs). A graph captures a grid that bounds every step of its
    shape and replays whatever `stage` wrote before it; an eager forward launches exactly
    its tiles, and nothing when no row is adapted."""

    def __init__(self, capacity: int, num_slots: int, device: torch.device) -> None:
        self.rows_cap = capacity
        self.num_slots = num_slots
        self.tiles_cap = tile_bound(capacity, DECODE_BLOCK_M, num_slots)
        self.on_gpu = device.type == "cuda"
        self.static = torch.full((capacity + 3 * self.tiles_cap,), -1, dtype=torch.int32,
                                 device=device)
        self.static[:capacity] = 0  # valid rows, whatever a graph's warm-up reads
        self.host_key: tuple[list[int], list[int], bool] = ([], [], True)
        self.plan = TilePlan([], [], DECODE_BLOCK_M)
        self.staged = split_packed(self.static, capacity)  # (order, tiles) of `plan`
        self.order, self.tiles = self.staged
        self.num_tiles = 0  # the kernels' grid this forward (0: no launch)
        self.block_m = DECODE_BLOCK_M
        self.launched: set[int] = set()  # row tilings launched at least once (compiled)
        self.runs: list[tuple[int, int, int]] = []  # CPU path: (slot, first row, end row)

    def stage(self, slots: list[int], lens: list[int], is_decode: bool) -> None:
        """The next step's slot and row count per segment, before its forward (and before
        any replay)."""
        if (slots, lens, is_decode) == self.host_key:
            return
        self.host_key = (slots, lens, is_decode)
        self.plan = TilePlan.of(slots, lens, block_m_for(sum(lens), is_decode))
        rows, tiles = len(self.plan.order), len(self.plan.tiles)
        if rows <= self.rows_cap and tiles <= self.tiles_cap:
            self.static.copy_(self._host(self.plan.pack(self.rows_cap, self.tiles_cap)),
                              non_blocking=True)
            self.staged = split_packed(self.static, self.rows_cap)
        else:
            packed = self._host(self.plan.pack(rows, tiles))
            self.staged = split_packed(packed.to(self.static.device, non_blocking=True), rows)

    def _host(self, packed: torch.Tensor) -> torch.Tensor:
        # pinned, so the copy is asynchronous: the in-flight step (overlap scheduling) is
        # not waited for
        return packed.pin_memory() if self.on_gpu else packed

    def begin(self, batch) -> None:
        """Called by the model at the start of a forward over `batch` (a ForwardBatch)."""
        capturing = self.on_gpu and torch.cuda.is_current_stream_capturing()
        self.bind(list(batch.extend_lens_cpu), batch.is_decode, capturing)

    def bind(self, lens: list[int], is_decode: bool, capturing: bool) -> None:
        """Point the kernels at this forward's plan: a graph being captured at the static
        buffers, with the grid of the most tiles a step of its shape can make."""
        if not capturing and (self.host_key[1], self.host_key[2]) != (lens, is_decode):
            self.stage([-1] * len(lens), lens, is_decode)  # a graph's warm-up: no adapter
        self.runs = [] if self.on_gpu else _runs(self.host_key[0], lens)
        self.block_m = block_m_for(sum(lens), is_decode)
        if capturing:
            self.order, self.tiles = split_packed(self.static, self.rows_cap)
            self.num_tiles = tile_bound(sum(lens), self.block_m, self.num_slots)
        else:
            self.order, self.tiles = self.staged
            # nothing to launch without an adapted row, except once per tiling: every
            # program exits, but the kernels compile in the warm-up, not at a first request
            first = self.block_m not in self.launched
            self.num_tiles = len(self.plan.tiles) or int(first)
        self.launched.add(self.block_m)


def _runs(slots: list[int], lens: list[int]) -> list[tuple[int, int, int]]:
    """(slot, first row, end row) of each run of adapted rows, adjacent segments of one
    slot merged."""
    runs: list[tuple[int, int, int]] = []
    at = 0
    for slot, n in zip(slots, lens):
        if slot >= 0 and runs and runs[-1][0] == slot and runs[-1][2] == at:
            runs[-1] = (slot, runs[-1][1], at + n)
        elif slot >= 0:
            runs.append((slot, at, at + n))
        at += n
    return runs


class LoRAHook:
    """Set as `linear.lora`: LinearBase.matmul calls it with the input and the base output."""

    def __init__(self, group: LinearSlots, pool: SlotRanks, batch: LoRABatch,
                 tile_n: int | None) -> None:
        self.group, self.pool, self.batch, self.tile_n = group, pool, batch, tile_n

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        st, g = self.batch, self.group
        if x.is_cuda:
            from engine.kernels.lora import lora_sgmv

            lora_sgmv(x, y, g.a, g.b, self.pool.ranks, st.order, st.tiles, st.num_tiles,
                      st.block_m, g.bounds, self.tile_n)
            return y
        for slot, start, end in st.runs:
            y[start:end] += self.delta(x[start:end], slot)
        return y

    def delta(self, x: torch.Tensor, slot: int) -> torch.Tensor:
        """x's LoRA delta under `slot`, in torch (the CPU path and the kernels' reference)."""
        g, r = self.group, self.pool.rank
        xa = x @ g.a[slot].T
        out = torch.empty(x.shape[0], g.b.shape[1], dtype=x.dtype, device=x.device)
        offset = 0
        for p, size in enumerate(g.part_sizes):
            out[:, offset:offset + size] = xa[:, p * r:(p + 1) * r] @ g.b[slot, offset:offset + size].T
            offset += size
        return out
