"""Segmented LoRA matmul (S-LoRA / Punica's SGMV) over a step's rows grouped by adapter.

The rows arrive as tiles of a permutation sorted by adapter slot (engine/lora/tiles.py):
`Order` lists the adapted rows, `Tiles` [3, cap] each tile's slot (-1: skip), first and end
entry of `Order`. Two launches per adapted linear:
- shrink: x[rows] @ A[slot]^T, with K split across programs (a long sequential K loop
  is latency-bound: a decode step has a handful of tiles), each split writing its fp32
  partial sums [splits, entries, parts * R];
- expand: y[rows, part cols] += (sum of the partials)[:, part's R] @ B[slot]^T. A program
  sums its rows' partials once, in a fixed order (deterministic, no reduction launch), then
  walks up to `max_cols` column tiles of one part: loading and summing them per column tile
  cost a prefill 5x what cuBLAS takes for the same product.
A slot's rank bounds the work (the pool pads every adapter to R): shrink skips rank tiles
past it, expand masks the columns past it. The grid depends only on the row count, the linear's
shape and the tiling (`Tiling`), so a CUDA graph captured for a batch size replays any mix
of adapters staged into its static `Order` and `Tiles`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.launch import pdl_launch, pdl_prologue


@dataclass(frozen=True)
class Tiling:
    """Tile sizes of one step's launches: decode (few rows per adapter, split K wide) or
    long segments (prefill: big row tiles, fewer splits)."""

    block_m: int
    block_k: int
    max_n: int  # the expand's widest column tile
    max_splits: int
    max_cols: int = 1  # column tiles one expand program walks (its input loaded once for all)
    split_min: int = 512  # K per shrink program, at least


DECODE = Tiling(block_m=16, block_k=128, max_n=256, max_splits=16)
LONG = Tiling(block_m=64, block_k=64, max_n=256, max_splits=4, max_cols=8)


def tiling_for(block_m: int) -> Tiling:
    return LONG if block_m == LONG.block_m else DECODE


def most_splits(k: int, tiling: Tiling) -> int:
    return min(triton.cdiv(k, tiling.split_min), tiling.max_splits)


def k_splits(k: int, tiling: Tiling, num_tiles: int) -> tuple[int, int]:
    """(splits, K per split): enough programs to fill the GPU, no split under split_min."""
    splits = most_splits(k, tiling)
    if tiling is LONG:  # many row tiles already fill the GPU
        splits = max(1, min(splits, 64 // max(num_tiles, 1)))
    per = triton.cdiv(triton.cdiv(k, splits), tiling.block_k) * tiling.block_k
    return triton.cdiv(k, per), per


@triton.jit
def _tile(Order, Tiles, tile_cap, BLOCK_M: tl.constexpr):
    """This program's tile: its entries of Order, their mask and their rows."""
    tile = tl.program_id(0)
    first = tl.load(Tiles + tile_cap + tile)
    end = tl.load(Tiles + 2 * tile_cap + tile)
    entries = first + tl.arange(0, BLOCK_M)
    mask = entries < end
    rows = tl.load(Order + entries, mask=mask, other=0).to(tl.int64)
    return entries.to(tl.int64), mask, rows


@triton.jit
def _dot(a, b, F32_DOT: tl.constexpr):
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


# (sizes that change from step to step are not specialized on: no recompiles)
@triton.jit(do_not_specialize=["tile_cap", "stride_ps"])
def _shrink_kernel(X, A, Part, Order, Tiles, Ranks, tile_cap, k_dim, k_split, r_pool,
                   stride_x, stride_as, stride_ar, stride_ps, stride_pt,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   F32_DOT: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    slot = tl.load(Tiles + tl.program_id(0))
    r0 = tl.program_id(1) * BLOCK_R
    if slot >= 0:
        rank = tl.load(Ranks + slot)
        if r0 % r_pool < rank:
            entries, mask_m, rows = _tile(Order, Tiles, tile_cap, BLOCK_M)
            offs_r = r0 + tl.arange(0, BLOCK_R)
            mask_r = offs_r % r_pool < rank
            k_lo = tl.program_id(2) * k_split
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for k0 in range(k_lo, k_lo + k_split, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                mk = kk < k_dim
                x = tl.load(X + rows[:, None] * stride_x + kk[None, :],
                            mask=mask_m[:, None] & mk[None, :], other=0.0)
                a = tl.load(A + slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar
                            + kk[:, None], mask=mask_r[None, :] & mk[:, None], other=0.0)
                acc += _dot(x, a, F32_DOT)
            ptrs = Part + tl.program_id(2).to(tl.int64) * stride_ps + entries[:, None] * stride_pt
            tl.store(ptrs + offs_r[None, :], acc, mask=mask_m[:, None])


@triton.jit(do_not_specialize=["tile_cap", "splits", "stride_ps"])
def _expand_kernel(Part, B, Y, Order, Tiles, Ranks, tile_cap, n_dim, r_pool, splits, bound1,
                   bound2, stride_ps, stride_pt, stride_bs, stride_bn, stride_y,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   COLS: tl.constexpr, F32_DOT: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    slot = tl.load(Tiles + tl.program_id(0))
    if slot >= 0:
        entries, mask_m, rows = _tile(Order, Tiles, tile_cap, BLOCK_M)
        rank = tl.load(Ranks + slot)
        n_first = tl.program_id(1) * (BLOCK_N * COLS)
        # the fused linear's part these COLS column tiles belong to (they never straddle parts)
        part = (n_first >= bound1).to(tl.int32) + (n_first >= bound2).to(tl.int32)
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        # the rows' [BLOCK_M, rank] input, the splits' partials summed in order, once for
        # all COLS column tiles
        ptrs = Part + entries[:, None] * stride_pt + (part * r_pool + offs_r)[None, :]
        mask = mask_m[:, None] & mask_r[None, :]
        xa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for s in range(splits):
            xa += tl.load(ptrs + s * stride_ps, mask=mask, other=0.0)
        xa = xa.to(B.dtype.element_ty)
        b_base = B + slot.to(tl.int64) * stride_bs + offs_r[:, None]
        for c in range(COLS):
            offs_n = n_first + c * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < n_dim
            b = tl.load(b_base + offs_n[None, :] * stride_bn,
                        mask=mask_r[:, None] & mask_n[None, :], other=0.0)
            y_ptrs = Y + rows[:, None] * stride_y + offs_n[None, :]
            y_mask = mask_m[:, None] & mask_n[None, :]
            y = tl.load(y_ptrs, mask=y_mask, other=0.0)
            y = y.to(tl.float32) + _dot(xa, b, F32_DOT)
            tl.store(y_ptrs, y.to(Y.dtype.element_ty), mask=y_mask)


def column_tile(bounds: list[int]) -> int | None:
    """The expand kernel's widest column tile: the largest of 256 ... 16 that divides every
    part boundary (None: the torch path must serve this linear)."""
    for tile in (256, 128, 64, 32, 16):
        if all(b % tile == 0 for b in bounds):
            return tile
    return None


def columns_per_program(edges: list[int], block_n: int, tiling: Tiling) -> int:
    """How many column tiles one expand program walks: the most, up to max_cols, that keeps
    it inside one part of the fused linear (`edges`: 0, the part boundaries, the width)."""
    tiles = [(hi - lo) // block_n for lo, hi in zip(edges, edges[1:])]
    cols = tiling.max_cols
    while cols > 1 and any(t % cols for t in tiles):
        cols //= 2
    return cols


def rank_tile(r_pool: int, tiling: Tiling) -> int:
    """Shrink's rank tile: 16 for decode (more programs), up to 64 for long segments (one
    load of x feeds more of the rank)."""
    if tiling is DECODE:
        return 16
    return next(t for t in (64, 32, 16) if r_pool % t == 0)


def lora_sgmv(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              ranks: torch.Tensor, order: torch.Tensor, tiles: torch.Tensor, num_tiles: int,
              block_m: int, bounds: list[int], tile_n: int) -> None:
    """y += each adapted row's LoRA delta, in place. x [T, in], y [T, out],
    a [slots, P*R, in], b [slots, out, R], ranks [slots]; `order` and `tiles` [3, cap] as
    engine/lora/tiles.py packs them; `num_tiles` the grid (tiles past the plan's are -1)."""
    if num_tiles == 0:
        return
    x = x.contiguous()
    t, k = x.shape
    pr, r, n = a.shape[1], b.shape[2], b.shape[1]
    tiling = tiling_for(block_m)
    splits, k_split = k_splits(k, tiling, num_tiles)
    part = torch.empty(splits, t, pr, dtype=torch.float32, device=x.device)
    # fp32 operands in IEEE precision for fp32 models and under the CPU interpreter (whose
    # bf16 dot is wrong); bf16/fp16 dots with fp32 accumulation otherwise
    f32_dot = x.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    block_r = rank_tile(r, tiling)
    tile_cap = tiles.shape[1]
    _shrink_kernel[(num_tiles, pr // block_r, splits)](
        x, a, part, order, tiles, ranks, tile_cap, k, k_split, r, x.stride(0), a.stride(0),
        a.stride(1), part.stride(0), part.stride(1), BLOCK_M=tiling.block_m, BLOCK_R=block_r,
        BLOCK_K=tiling.block_k, F32_DOT=f32_dot, **pdl_launch(x.device))
    big = n + 1  # a boundary past the last column: no part there
    b1 = bounds[0] if bounds else big
    b2 = bounds[1] if len(bounds) > 1 else big
    block_n = min(tile_n, tiling.max_n)
    cols = columns_per_program([0, *bounds, n], block_n, tiling)
    _expand_kernel[(num_tiles, triton.cdiv(n, block_n * cols))](
        part, b, y, order, tiles, ranks, tile_cap, n, r, splits, b1, b2, part.stride(0),
        part.stride(1), b.stride(0), b.stride(1), y.stride(0), BLOCK_M=tiling.block_m,
        BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(r)), COLS=cols,
        F32_DOT=f32_dot, **pdl_launch(x.device))
