"""The segmented LoRA kernels (engine/kernels/lora.py) against a plain torch loop (GPU
only; `TRITON_INTERPRET=1` runs them on the CPU, as tests/test_lora.py does)."""
from __future__ import annotations

import pytest
import torch

from test_triton_attention import DEVICE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU (or TRITON_INTERPRET=1)"),
]


def _reference(x, y, a, b, ranks, indptr, slots, part_sizes, r_pool):
    out = y.clone().float()
    for seg, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        rows = slice(indptr[seg].item(), indptr[seg + 1].item())
        rank = ranks[slot].item()
        offset = 0
        for p, size in enumerate(part_sizes):
            a_p = a[slot, p * r_pool:p * r_pool + rank].float()
            b_p = b[slot, offset:offset + size, :rank].float()
            out[rows, offset:offset + size] += x[rows].float() @ a_p.T @ b_p.T
            offset += size
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seg_lens,part_sizes", [
    ([1, 1, 1, 1, 1], (64, 32, 32)),  # decode: q, k, v parts
    ([3, 40, 1, 17], (96, 96)),  # mixed extend: gate, up
    ([5, 2], (48,)),  # one part, a width not a multiple of the column tile
])
def test_sgmv_matches_torch(dtype, seg_lens, part_sizes):
    from engine.kernels.lora import column_tile, lora_sgmv

    torch.manual_seed(0)
    dev, k, r_pool, num_slots = DEVICE, 80, 32, 3
    n, parts = sum(part_sizes), len(part_sizes)
    a = torch.randn(num_slots, parts * r_pool, k, device=dev).to(dtype) * 0.1
    b = torch.randn(num_slots, n, r_pool, device=dev).to(dtype) * 0.1
    ranks = torch.tensor([8, 32, 20], dtype=torch.int32, device=dev)
    for s, rank in enumerate(ranks.tolist()):  # the pool keeps what lies past a rank zero
        for p in range(parts):
            a[s, p * r_pool + rank:(p + 1) * r_pool] = 0
        b[s, :, rank:] = 0
    slots = torch.tensor([(i % (num_slots + 1)) - 1 for i in range(len(seg_lens))],
                         dtype=torch.int32, device=dev)  # -1 (the base) first, then each slot
    indptr = torch.tensor([0] + list(torch.tensor(seg_lens).cumsum(0)), dtype=torch.int32,
                          device=dev)
    t = sum(seg_lens)
    x = torch.randn(t, k, device=dev).to(dtype)
    y = torch.randn(t, n, device=dev).to(dtype)
    bounds = list(torch.tensor(part_sizes[:-1]).cumsum(0).tolist())
    expected = _reference(x, y, a, b, ranks, indptr, slots, part_sizes, r_pool)
    lora_sgmv(x, y, a, b, ranks, indptr, slots, len(seg_lens), max(seg_lens), bounds,
              column_tile(bounds + [n]))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.float(), expected, atol=tol, rtol=tol)
