"""Tile sizes and launch options of one Triton GEMM-like kernel launch.

The MoE and FP8 kernels each pick theirs per shape from a sweep on the GPU
(scripts/bench_layer_kernels.py): a BLOCK_N x BLOCK_K tile of the weight per program step,
and the warps and pipeline stages of the launch. `split_k` > 1 (the FP8 weight-only kernel)
cuts K into that many slices, one program each, summed by a second launch: at one row a long
K leaves too few programs to keep the memory system busy.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tiles:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    # One-row GEMV with float8 weights: multiply-adds on the tensor cores in f16 (a 16-row
    # tl.dot, row 0 real) instead of converting every weight to float32 on the CUDA cores.
    row_dot: bool = False
