"""The FP8 weight kernels (engine/kernels/fp8.py) against torch references.

Marked `gpu` and skipped without CUDA; tests/test_fp8.py runs the weight-only GEMM cases
through TRITON_INTERPRET=1 on the CPU (float32 activations: the interpreter's bf16 `tl.dot`
and its float8 casts are not exact; both run here on a GPU). tests/test_fp8.py also
compiles every variant for sm_90.
"""
from __future__ import annotations

import os

import pytest
import torch

from engine.quantization import fp8
from engine.kernels.tiles import Tiles
from engine.kernels.fp8 import quantize_rows
from engine.kernels.gemv import w8a16_linear

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else ("cpu" if INTERPRET else None)
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU (or TRITON_INTERPRET=1)")]
cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="float8 casts and bf16 dots: GPU only")

DTYPES = [torch.float32] + ([] if INTERPRET else [torch.bfloat16])
# (rows, out features, in features): batch 1 (CUDA cores), a few rows and 16 (tensor cores),
# widths not multiples of the tiles; on a GPU, Llama-3-8B's down projection.
SHAPES = [(1, 72, 200), (3, 72, 200), (16, 40, 136)] + \
    ([] if INTERPRET else [(1, 4096, 14336), (8, 4096, 14336)])


def random_fp8_weight(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    weight, scale = fp8.quantize_rows(torch.randn(n, k, generator=g) / k ** 0.5)
    return weight.to(DEVICE), scale.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("config", [Tiles(32, 256, num_stages=4), Tiles(block_n=16, block_k=64, num_warps=2, num_stages=4),
                                    Tiles(32, 64, split_k=3), Tiles(64, 128, split_k=8)],
                         ids=["default", "small_tiles", "split3", "split8"])
def test_w8a16_matches_dequantized_matmul(shape, dtype, config):
    m, n, k = shape
    weight, scale = random_fp8_weight(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    ref = x.double() @ fp8.dequantize(weight, scale, torch.float64).t()
    out = w8a16_linear(x, weight, scale, config)
    assert out.dtype == dtype and out.shape == (m, n)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding
    assert (out.double() - ref).abs().max().item() <= tol * (1 + ref.abs().max().item())


def random_block_scaled_weight(n: int, k: int, group: int, seed: int):
    """A float8 weight with one scale per (row, `group`-wide run of K) as checkpoints' block
    scales arrive ([N, K / group], rows of a block repeating their block's scales), the
    scales spread over 2^-3..2^3 so a kernel that applies the wrong group shows."""
    g = torch.Generator().manual_seed(seed)
    weight = fp8.to_fp8(torch.randn(n, k, generator=g) * 100)
    scale = 2.0 ** torch.randint(-3, 4, (-(-n // 128), k // group), generator=g).float() / (100 * k ** 0.5)
    return weight.to(DEVICE), scale.repeat_interleave(128, dim=0)[:n].contiguous().to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 72, 256), (3, 200, 512), (16, 40, 384)] +
                         ([] if INTERPRET else [(1, 4096, 14336), (8, 6144, 4096)]),
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("config", [None, Tiles(32, 256, num_stages=4), Tiles(16, 64, split_k=3),
                                    Tiles(64, 128, split_k=4, row_dot=True)],
                         ids=["default", "wide_k_steps", "split3", "row_dot"])
def test_block_scaled_weights_in_the_weight_only_kernel(shape, dtype, config):
    """Block-scaled float8 weights (HF `fp8` / compressed-tensors block checkpoints, scales
    [N, K / 128]) through the weight-only GEMV at decode-sized batches: each K step scaled by
    its group's scales (K steps wider than a group are narrowed to it), equal to the
    dequantized matmul; so is the SwiGLU form."""
    m, n, k = shape
    weight, scale = random_block_scaled_weight(n, k, 128, seed=n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    dense = fp8.dequantize(weight, scale, torch.float64)
    ref = x.double() @ dense.t()
    out = w8a16_linear(x, weight, scale, config)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding
    assert (out.double() - ref).abs().max().item() <= tol * (1 + ref.abs().max().item())
    if config is None and n % 2 == 0:  # [gate; up] halves: silu(gate) * up in one launch
        from engine.kernels.gemv import gemv_glu

        h = (x.double() @ dense.t()).to(dtype)
        glu = torch.nn.functional.silu(h[:, : n // 2]) * h[:, n // 2:]
        out = gemv_glu(x, weight, scale)
        assert (out.double() - glu.double()).abs().max().item() <= 2 * tol * (1 + glu.abs().max().item())


@pytest.mark.parametrize("shape", [(72, 200), (40, 1000)] + ([] if INTERPRET else [(6144, 4096), (4096, 14336)]),
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("config", [Tiles(64, 128, split_k=4, row_dot=True),
                                    Tiles(32, 64, row_dot=True)], ids=["split4", "one_slice"])
def test_one_row_on_the_tensor_cores(shape, config):
    """`row_dot`: bf16 activations scaled into f16 times the float8 weight on the tensor
    cores. As exact as the CUDA-core path for activations of any usual size: the f16 cast
    loses nothing from 2^-10 to 2^20, and outside that only bits far below the output's
    rounding (the row's tiny entries) or, past 2^20, never seen activations."""
    n, k = shape
    weight, scale = random_fp8_weight(n, k, seed=n)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, k, generator=g) * 3
    x[0, :8] = torch.tensor([5e4, -2e5, 1e-3, -3e-4, 0.0, 7e-6, 1e5, -1.0])  # both ends
    x = x.to(DEVICE, torch.bfloat16)
    ref = x.double() @ fp8.dequantize(weight, scale, torch.float64).t()
    out = w8a16_linear(x, weight, scale, config)
    cuda_cores = w8a16_linear(x, weight, scale, Tiles(64, 128, split_k=4))
    assert out.dtype == torch.bfloat16 and out.shape == (1, n)
    bound = 1e-2 * ref.abs().max().item()  # the bf16 output's rounding
    assert (out.double() - ref).abs().max().item() <= bound
    assert (out.double() - cuda_cores.double()).abs().max().item() <= bound


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 100, 200), (4, 72, 136), (16, 40, 200)] +
                         ([] if INTERPRET else [(1, 14336, 4096), (16, 14336, 4096)]),
                         ids=lambda s: "x".join(map(str, s)))
def test_glu_gemv_matches_the_dequantized_mlp_middle(shape, dtype):
    """`gemv_glu` on float8 [gate; up] weights: silu(x gate^T) * (x up^T) as the dequantized
    torch path computes it (the gate_up linear, then SiluAndMul)."""
    from engine.kernels.gemv import gemv_glu

    m, n, k = shape
    weight, scale = random_fp8_weight(2 * n, k, seed=n + m)
    x = (2 * torch.randn(m, k, generator=torch.Generator().manual_seed(3))).to(DEVICE, dtype)
    h = x.double() @ fp8.dequantize(weight, scale, torch.float64).t()
    ref = torch.nn.functional.silu(h[:, :n]) * h[:, n:]
    out = gemv_glu(x, weight, scale)
    assert out.dtype == dtype and out.shape == (m, n)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.double() - ref).abs().max().item() <= tol * (1 + ref.abs().max().item())


@cuda_only
def test_fp8_linear_dispatch_on_gpu():
    """Decode-sized batches take the weight-only kernel, larger ones `_scaled_mm`; both
    close to the dequantized bf16 product."""
    weight, scale = random_fp8_weight(256, 512, seed=3)
    dense = fp8.dequantize(weight, scale, torch.float32)
    for rows in (1, 16, 17, 300):
        x = torch.randn(rows, 512, device=DEVICE).bfloat16()
        out = fp8.fp8_linear(x, weight, scale, None)
        ref = x.float() @ dense.t()
        # W8A8 above 16 rows: the activations' rounding to float8 (~2^-4 relative) shows
        tol = 0.02 if rows <= 16 else 0.08
        assert (out.float() - ref).abs().max().item() <= tol * ref.abs().max().item(), rows


@cuda_only
@pytest.mark.parametrize("k", [4096, 14336])
def test_fast_accumulation_error_is_small_beside_fp8_rounding(k):
    """`_scaled_mm` with use_fast_accum (`EngineConfig.fp8_fast_accum`, the default): the
    product of the float8 operands stays within 5e-3 relative (Frobenius) of its float32
    value; float32 promotion within 2.5e-3 (the bf16 output's own rounding is ~1.7e-3).
    Measured on an H200 (scripts/bench_layer_kernels.py --fp8-accum): 2.1e-3 at
    K 4,096, 3.3e-3 at 14,336, against ~3.7e-2 that rounding the operands to float8 costs."""
    torch.backends.cuda.matmul.allow_tf32 = False
    weight, scale = random_fp8_weight(1024, k, seed=5)
    x = torch.randn(512, k, device=DEVICE).bfloat16()
    xq, sx = quantize_rows(x)
    exact = (xq.float() * sx) @ (weight.float() * scale).t()

    def rel(y):
        return ((y.float() - exact).norm() / exact.norm()).item()

    fast = fp8.fp8_linear(x, weight, scale, None, fast_accum=True)
    precise = fp8.fp8_linear(x, weight, scale, None, fast_accum=False)
    assert rel(fast) < 5e-3 and rel(precise) < 2.5e-3, (rel(fast), rel(precise))
    assert not torch.equal(fast, precise)  # the two settings do differ on the GPU
    assert torch.equal(fast, torch._scaled_mm(xq, weight.t(), scale_a=sx, scale_b=scale.t(),
                                              out_dtype=torch.bfloat16, use_fast_accum=True))


@cuda_only
@pytest.mark.parametrize("shape", [(1, 4096), (7, 14336), (300, 4096), (2, 100)])
def test_quantize_rows_kernel_equals_torch(shape):
    x = torch.randn(*shape, device=DEVICE).bfloat16() * 3
    x[0, :7] = 0  # rows and runs of zeros
    q, s = quantize_rows(x)
    _, s_ref = fp8.quantize_rows(x)
    # torch divides by the constant as a multiply by its reciprocal: the last bit may differ
    torch.testing.assert_close(s, s_ref, rtol=2e-7, atol=0)
    q_ref = fp8.to_fp8(x.float() / s)  # the same scale: the same float8 bits
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@cuda_only
def test_fp8_model_on_gpu_is_the_dequantized_model(tiny_llama):
    """A whole model with on-the-fly FP8 weights on the GPU (decode-sized batches: the
    weight-only kernel) gives the logits of the same model with those weights dequantized,
    and stays close to the unquantized model (top-1 agreement reported)."""
    from engine.models import load_model
    from test_fp8 import _prompt_logits, _rel, dequantize_fp8_
    from test_models import random_sequences

    model = load_model(tiny_llama, dtype="float32", device=DEVICE, quantization="fp8")
    dequantized = load_model(tiny_llama, dtype="float32", device=DEVICE, quantization="fp8")
    dequantize_fp8_(dequantized)
    full = load_model(tiny_llama, dtype="float32", device=DEVICE)
    prompts = random_sequences(model.config.vocab_size, [5, 7], seed=4)  # 12 rows: <= 16
    logits = _prompt_logits(model, prompts)
    torch.testing.assert_close(logits, _prompt_logits(dequantized, prompts), atol=1e-4, rtol=1e-4)
    ref = _prompt_logits(full, prompts)
    top1 = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"fp8 weights on the GPU: relative logit error {_rel(logits, ref):.3f}, top-1 {top1:.2f}")
    assert top1 > 0.6


@cuda_only
def test_block_scaled_checkpoint_on_gpu_is_its_dequantized_model(tiny_llama, tmp_path):
    """An HF FineGrainedFP8 checkpoint (block scales) on the GPU: decode-sized batches take
    the weight-only kernel with its block scales (they dequantized the whole weight every
    step before), and the logits equal the dequantized checkpoint's."""
    from engine.layers.linear import LinearBase
    from engine.models import load_model
    from fp8_checkpoints import write_fp8_checkpoints
    from test_fp8 import _prompt_logits
    from test_models import random_sequences

    fp8_dir, deq_dir = write_fp8_checkpoints(tiny_llama, tmp_path, "fp8-block")
    model = load_model(fp8_dir, dtype="float32", device=DEVICE)
    layers = [m for m in model.modules() if isinstance(m, LinearBase) and m.weight_scale is not None]
    assert layers and all(m.weight_scale.shape[1] > 1 for m in layers)
    x = torch.randn(3, layers[0].weight.shape[1], device=DEVICE)
    assert fp8.takes_weight_only_kernel(x, layers[0].weight_scale)
    ref = load_model(deq_dir, dtype="float32", device=DEVICE)
    prompts = random_sequences(model.config.vocab_size, [5, 7], seed=4)  # 12 rows
    torch.testing.assert_close(_prompt_logits(model, prompts), _prompt_logits(ref, prompts),
                               atol=1e-4, rtol=1e-4)


@cuda_only
def test_norms_and_silu_quantize_for_the_fp8_linears(tiny_llama):
    """With fused kernels an FP8 model's norms and SiLU-and-mul quantize the next linear's
    input in their own launch (prefill-sized batches): the logits are those of the linears
    quantizing it themselves, bit for bit."""
    from engine.config import KernelConfig
    from engine.layers import set_fused_kernels
    from engine.models import load_model
    from test_fp8 import _prompt_logits
    from test_models import random_sequences

    model = load_model(tiny_llama, dtype="float32", device=DEVICE, quantization="fp8")
    prompts = random_sequences(model.config.vocab_size, [30, 11], seed=5)  # 41 rows: > 16
    set_fused_kernels(model, True)
    layer = model.model.layers[0]
    assert layer.input_layernorm.quantizes_for(41) and not layer.input_layernorm.quantizes_for(16)
    fused = _prompt_logits(model, prompts)
    set_fused_kernels(model, True, KernelConfig(fused_fp8_quant=False))
    assert layer.input_layernorm.quantizes_for is None
    assert torch.equal(fused, _prompt_logits(model, prompts))
