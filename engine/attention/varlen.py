"""Attention over a packed batch with no KV cache: the pooling tasks' one forward.

Many short inputs are packed into one ragged batch of T tokens (no padding in the linears,
which hold almost all of the FLOPs). On the GPU attention runs packed too: the Triton
kernel of engine/kernels/attention/varlen.py walks each sequence's own rows through
`cu_seqlens`, so no padding, no mask tensor and no per-shape SDPA backend choice (one
kernel for every length mix). Elsewhere (the CPU) attention sees the batch as a [B, Lmax]
grid with a mask that keeps each sequence to itself; the pooling engine sorts inputs by
length before packing, so the grid's padding stays small."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.attention.base import ForwardBatch


@dataclass
class PackedLayout:
    """The sequences of one packed forward, shared by every layer: their lengths (host),
    their bounds on the device and whether attention runs the Triton kernel. Building one
    syncs nothing; the padded path's grid index and mask are made on its first layer."""

    lens: list[int]
    cu_seqlens: torch.Tensor  # [B + 1] int32 on the device: sequence i is rows [cu[i], cu[i+1])
    max_len: int
    use_triton: bool
    _grid: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @classmethod
    def of(cls, lens: list[int], device: torch.device, use_triton: bool = False) -> PackedLayout:
        cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return cls(list(lens), cu.to(device), max(lens), use_triton)

    def grid(self, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(each token's place in the flattened [B, Lmax] grid [T], the mask
        [B, 1, Lmax|1, Lmax] of which keys each query sees) for the padded path."""
        if self._grid is None:
            device, lmax = self.cu_seqlens.device, self.max_len
            starts = self.cu_seqlens[:-1].long()
            lens_t = self.cu_seqlens[1:].long() - starts
            valid = torch.arange(lmax, device=device)[None, :] < lens_t[:, None]
            mask = valid[:, None, None, :]  # other sequences' keys and padding are never seen
            if causal:
                mask = mask & torch.ones(lmax, lmax, dtype=torch.bool, device=device).tril()
            shift = torch.arange(len(self.lens), device=device) * lmax - starts
            total = sum(self.lens)
            index = torch.arange(total, device=device) + shift.repeat_interleave(
                lens_t, output_size=total)
            self._grid = (index, mask)
        return self._grid


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout,
                     causal: bool, scale: float) -> torch.Tensor:
    """q [T, Hq, D], k and v [T, Hkv, D] of sequences of `layout.lens` tokens, back to back
    -> [T, Hq, D]; each token attends within its own sequence (causally when `causal`)."""
    if layout.use_triton:
        from engine.kernels.attention.varlen import triton_varlen_attention

        return triton_varlen_attention(q, k, v, layout.cu_seqlens, layout.max_len, causal, scale)
    if len(layout.lens) == 1:
        return _dense(q, k, v, causal, scale)
    b, lmax = len(layout.lens), layout.max_len
    index, mask = layout.grid(causal)
    qg, kg, vg = (_to_grid(x, index, b, lmax) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale,
                                         enable_gqa=group > 1)
    return out.transpose(1, 2).reshape(b * lmax, q.shape[1], q.shape[2])[index]


def _to_grid(x: torch.Tensor, index: torch.Tensor, b: int, lmax: int) -> torch.Tensor:
    grid = x.new_zeros(b * lmax, x.shape[1], x.shape[2])
    grid[index] = x
    return grid.view(b, lmax, x.shape[1], x.shape[2]).transpose(1, 2)  # [B, H, Lmax, D]


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
           scale: float) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=causal, scale=scale, enable_gqa=group > 1)
    return out.transpose(0, 1)


class PackedCausalBackend:
    """The attention backend a decoder model (the Llama/Qwen paths) runs under when it is an
    embedder: causal attention within each packed sequence of `batch.extend_lens_cpu`, no
    KV written anywhere (nothing is decoded after the one forward)."""

    supports_sliding_window = False

    def __init__(self, scale: float, use_triton: bool = False) -> None:
        self.scale = scale
        self.use_triton = use_triton
        self._batch: ForwardBatch | None = None
        self._layout: PackedLayout | None = None

    def prepare(self, batch: ForwardBatch) -> None:
        lens = batch.extend_lens_cpu
        self._batch = batch
        self._layout = PackedLayout(list(lens), batch.qo_indptr, max(lens), self.use_triton)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        if batch is not self._batch:
            self.prepare(batch)
        return varlen_attention(q, k, v, self._layout, True, self.scale)


def packed_batch(input_ids: torch.Tensor, positions: torch.Tensor, layout: PackedLayout,
                 max_context: int) -> ForwardBatch:
    """A ForwardBatch for `PackedCausalBackend` from a packed forward's device inputs
    (positions restart at 0 per sequence); the KV fields are empty (nothing reads them)."""
    device = input_ids.device
    cu = layout.cu_seqlens
    lens_t = cu[1:] - cu[:-1]
    empty = torch.empty(0, dtype=torch.int64, device=device)
    return ForwardBatch(
        input_ids=input_ids, positions=positions, out_slots=empty, req_rows=empty,
        seq_lens=lens_t, extend_lens=lens_t, qo_indptr=cu, logits_indices=cu[1:].long() - 1,
        req_to_token=torch.empty((0, max_context), dtype=torch.int32, device=device),
        is_decode=False, seq_lens_cpu=list(layout.lens), extend_lens_cpu=list(layout.lens))
