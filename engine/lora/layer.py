"""What a step's forward reads to add LoRA deltas: the step's segments (`LoRABatch`) and,
on each adaptable linear, a hook (`LoRAHook`) that adds its slots' deltas to the output.

On a GPU the hook runs the segmented Triton kernels (engine/kernels/lora.py) over the
segment tensors (in a CUDA graph, static buffers the step writes before replay); on a CPU a
torch matmul per run of rows under one adapter.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.lora.pool import LoRAPool, PoolGroup


class LoRABatch:
    """The current step's adapter per segment (a request's new tokens); -1: the base."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        # static: decode CUDA graphs read it (rows past the step's stay -1)
        self.slots = torch.full((capacity,), -1, dtype=torch.int32, device=device)
        self.host_slots: list[int] = []
        self.seg_indptr: torch.Tensor | None = None
        self.num_segments = 0
        self.max_seg_len = 0
        self.runs: list[tuple[int, int, int]] = []  # CPU path: (slot, first row, end row)

    def stage(self, slots: list[int]) -> None:
        """The next step's slot per segment, before its forward (and before any replay)."""
        if slots == self.host_slots:
            return
        self.host_slots = slots
        padded = slots + [-1] * (self.slots.numel() - len(slots))
        self.slots.copy_(torch.tensor(padded, dtype=torch.int32))

    def begin(self, batch) -> None:
        """Called by the model at the start of a forward over `batch` (a ForwardBatch)."""
        self.seg_indptr = batch.qo_indptr
        self.num_segments = batch.batch_size
        self.max_seg_len = max(batch.extend_lens_cpu, default=0)
        self.runs = []
        if batch.input_ids.is_cuda:
            return
        at = 0  # adjacent segments of one slot merge into one run of rows
        for slot, n in zip(self.host_slots, batch.extend_lens_cpu):
            if slot >= 0 and self.runs and self.runs[-1][0] == slot and self.runs[-1][2] == at:
                self.runs[-1] = (slot, self.runs[-1][1], at + n)
            elif slot >= 0:
                self.runs.append((slot, at, at + n))
            at += n


class LoRAHook:
    """Set as `linear.lora`: LinearBase.matmul calls it with the input and the base output."""

    def __init__(self, group: PoolGroup, pool: LoRAPool, batch: LoRABatch,
                 tile_n: int | None) -> None:
        self.group, self.pool, self.batch, self.tile_n = group, pool, batch, tile_n

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        st, g = self.batch, self.group
        if x.is_cuda:
            from engine.kernels.lora import lora_sgmv

            lora_sgmv(x, y, g.a, g.b, self.pool.ranks, st.seg_indptr, st.slots, st.num_segments,
                      st.max_seg_len, g.bounds, self.tile_n)
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
