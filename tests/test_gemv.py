"""The decode GEMV (engine/kernels/gemv.py) with unscaled weights (bf16 on GPUs; the FP8 path
is tests/test_fp8_kernels.py) against torch, the SwiGLU form (`gemv_glu`) against the
GEMV + SiLU-and-mul it replaces, and the one-row dispatch of `LinearBase`.

The `gpu` tests also run on the CPU under TRITON_INTERPRET=1 (float32 weights there: the
interpreter's bf16 arithmetic is not exact), from `test_gemv_under_the_interpreter`.
"""
from __future__ import annotations

import itertools
import os

import pytest
import torch

from engine.kernels.gemv import gemv, gemv_glu
from engine.kernels.tiles import Tiles

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else ("cpu" if INTERPRET else None)
DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16
gpu = pytest.mark.skipif(DEVICE is None, reason="needs CUDA or TRITON_INTERPRET=1")
CONFIGS = [None, Tiles(16, 64, num_stages=4), Tiles(32, 64, split_k=3), Tiles(64, 64, split_k=8)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", [(1, 96, 256), (1, 130, 1000), (3, 64, 300), (33, 72, 200),
                                   (64, 40, 128)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("config", CONFIGS, ids=["default", "tiles", "split3", "split8"])
def test_gemv_matches_matmul(shape, config):
    m, n, k = shape
    g = torch.Generator().manual_seed(n + k)
    weight = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, DTYPE)
    x = torch.randn(m, k, generator=g).to(DEVICE, DTYPE)
    out = gemv(x, weight, None, config)
    ref = x.double() @ weight.double().t()
    assert out.dtype == DTYPE and out.shape == (m, n)
    tol = 1e-5 if DTYPE == torch.float32 else 1e-2  # bf16: the output's rounding
    assert (out.double() - ref).abs().max().item() <= tol * (1 + ref.abs().max().item())


def silu_mul_reference(h: torch.Tensor) -> torch.Tensor:
    """The torch path of SiluAndMul on a [gate | up] output, rounded as the model rounds."""
    d = h.shape[-1] // 2
    return torch.nn.functional.silu(h[:, :d]) * h[:, d:]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", [(1, 48, 256), (1, 100, 1000), (3, 64, 300), (16, 40, 96)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("config", [None, Tiles(8, 64, num_stages=3), Tiles(32, 128)],
                         ids=["default", "bn8", "bn32"])
def test_gemv_glu_matches_gemv_then_silu_mul(shape, config):
    """Ragged N (100 = 6 blocks of 16 + 4) and K, one and several rows."""
    m, n, k = shape
    g = torch.Generator().manual_seed(n * k)
    weight = (torch.randn(2 * n, k, generator=g) / k ** 0.5).to(DEVICE, DTYPE)
    x = (2 * torch.randn(m, k, generator=g)).to(DEVICE, DTYPE)
    out = gemv_glu(x, weight, None, config)
    assert out.dtype == DTYPE and out.shape == (m, n)
    ref = silu_mul_reference(x.double() @ weight.double().t())
    tol = 1e-5 if DTYPE == torch.float32 else 2e-2
    assert (out.double() - ref).abs().max().item() <= tol * (1 + ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the dispatch is GPU-only")
def test_fp8_mlp_takes_the_glu_gemv_at_decode_batches():
    """A fused-kernel FP8 MLP runs gate_up and the activation in one launch up to 16 rows
    (the output equals the dequantized torch MLP's), not above; bf16 stays on two launches."""
    from types import SimpleNamespace

    from engine.layers import set_fused_kernels
    from engine.layers.parallel import TPContext
    from engine.models.llama import LlamaMLP
    from engine.quantization import fp8
    from engine.layers.fp8 import quantize_linears_

    torch.manual_seed(0)
    config = SimpleNamespace(hidden_size=512, intermediate_size=1408, hidden_act="silu")
    with torch.device("cuda"):
        mlp = LlamaMLP(config, TPContext()).to(torch.bfloat16)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=512 ** -0.5)
    set_fused_kernels(mlp, True)
    x1 = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    assert mlp.gate_up_proj.silu_mul_gemv(x1) is None  # bf16
    quantize_linears_(mlp)
    gate_up = fp8.dequantize(mlp.gate_up_proj.weight, mlp.gate_up_proj.weight_scale, torch.float32)
    down = fp8.dequantize(mlp.down_proj.weight, mlp.down_proj.weight_scale, torch.float32)
    for rows in (1, 3, 16):
        x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
        assert mlp.gate_up_proj.silu_mul_gemv(x) is not None
        ref = silu_mul_reference(x.float() @ gate_up.t()) @ down.t()
        out = mlp(x)
        assert (out.float() - ref).abs().max().item() <= 0.03 * ref.abs().max().item()
    assert mlp.gate_up_proj.silu_mul_gemv(torch.randn(17, 512, device="cuda",
                                                      dtype=torch.bfloat16)) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the dispatch is GPU-only")
def test_linear_takes_the_gemv_at_one_row():
    from engine.layers.linear import ReplicatedLinear

    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = ReplicatedLinear(512, 384, bias=True).to(torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=512 ** -0.5)
    torch.nn.init.normal_(layer.bias)
    for rows, gemv_rows in ((1, 1), (2, 1), (32, 64), (64, 64)):
        x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
        layer.gemv_rows = 0
        cublas = layer(x)
        layer.gemv_rows = gemv_rows  # RADIXSERVE_BF16_GEMV_ROWS raises it past 1
        out = layer(x)
        assert (out.float() - ref).abs().max().item() <= 0.02 * ref.abs().max().item()
        if rows > gemv_rows:  # past gemv_rows: cuBLAS either way
            assert torch.equal(out, cublas)


def test_gemv_under_the_interpreter():
    pytest.importorskip("triton")
    from triton_on_cpu import run_under_interpreter

    run_under_interpreter("test_gemv.py", allow_skipped=True)  # the dispatch test is GPU-only


def test_bf16_gemv_compiles_for_hopper():
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend")
    from triton_on_cpu import compile_for_sm90

    from engine.kernels.gemv import _gemv_kernel, gemv_config

    io = dict(X="*bf16", W="*bf16", Scale="*bf16", M="i32", N="i32", K="i32", k_per_split="i32",
              row_scale="fp32")
    shapes = ((6144, 4096), (4096, 14336), (28672, 4096), (128, 2048))  # qkv, down, gate_up, router
    for rows, (n, k) in itertools.product((1, 16, 32, 64), shapes):
        tiles = gemv_config(rows, n, k, weight_bytes=2)
        compile_for_sm90(_gemv_kernel, {**io, "Out": "*fp32" if tiles.split_k > 1 else "*bf16"},
                         dict(PRECISION="tf32", BLOCK_M=rows, BLOCK_N=tiles.block_n,
                              BLOCK_K=tiles.block_k, SPLIT_K=tiles.split_k, HAS_SCALE=False),
                         num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def test_bf16_gemv_rows_setting():
    from engine.layers import bf16_gemv_rows

    assert bf16_gemv_rows(None) == 1 and bf16_gemv_rows("32") == 32
    for bad in ("0", "65", "-1"):
        with pytest.raises(ValueError, match="RADIXSERVE_BF16_GEMV_ROWS"):
            bf16_gemv_rows(bad)


def test_glu_gemv_compiles_for_hopper():
    """Llama-3-8B's gate_up at one row, bf16 and float8 weights (the row-dot variant too)."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend")
    from triton_on_cpu import compile_for_sm90

    from engine.kernels.gemv import _gemv_kernel, glu_config

    for weight, scale, row_dot in (("*bf16", False, False), ("*fp8e4nv", True, False),
                                   ("*fp8e4nv", True, True)):
        tiles = glu_config(1, 14336, 4096, weight_bytes=2 if weight == "*bf16" else 1)
        io = dict(X="*bf16", W=weight, Scale="*fp32" if scale else weight, Out="*bf16", M="i32",
                  N="i32", K="i32", k_per_split="i32", row_scale="fp32")
        compile_for_sm90(_gemv_kernel, io,
                         dict(PRECISION="tf32", BLOCK_M=1, BLOCK_N=tiles.block_n,
                              BLOCK_K=tiles.block_k, SPLIT_K=1, HAS_SCALE=scale,
                              ROW_DOT=row_dot, GLU=True),
                         num_warps=tiles.num_warps, num_stages=tiles.num_stages)
