"""Fused Triton kernels (RMSNorm + residual, RoPE, SiLU-and-mul) vs the layers' torch path
(GPU only; `TRITON_INTERPRET=1` runs them on the CPU through Triton's interpreter).

The kernels round where the torch path rounds, so they agree to about one unit in the last
place of the model dtype; the tolerance is two ulps of each tensor's largest value.
"""
from __future__ import annotations

import pytest
import torch

from engine.layers.activation import SiluAndMul
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from test_triton_attention import DEVICE, DT

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU (or TRITON_INTERPRET=1)"),
]

ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-22}
# (rows, hidden) for the norms and (rows, d) for SiLU-and-mul: decode-sized and prefill-sized
ROWS = [(1, 4096), (7, 96), (300, 5120)]
# (tokens, q heads, kv heads, head dim)
ROPE = [(1, 32, 8, 128), (9, 4, 2, 64), (130, 16, 16, 80)]


def _compare(ref: torch.Tensor, got: torch.Tensor, dtype: torch.dtype) -> dict:
    ref, got = ref.float(), got.float()
    err = (ref - got).abs().max().item()
    tol = 2 * ULP[dtype] * max(ref.abs().max().item(), 1e-6)
    return {"err": err, "tol": tol, "ok": bool(torch.isfinite(got).all()) and err <= tol}


def _small(n: int, cpu_cap: int = 40) -> int:
    return min(n, cpu_cap) if DEVICE == "cpu" else n


def check_rmsnorm(rows: int, hidden: int, dtype: torch.dtype, seed: int) -> dict:
    torch.manual_seed(seed)
    rows = _small(rows)
    norm = RMSNorm(hidden, 1e-5).to(device=DEVICE)
    norm.weight.data = torch.randn(hidden, device=DEVICE)
    norm.to(dtype)
    x = torch.randn(rows, hidden, dtype=dtype, device=DEVICE)
    r = torch.randn(rows, hidden, dtype=dtype, device=DEVICE)
    ref, (ref2, ref_res) = norm(x), norm(x, r)
    norm.fused = True
    got, (got2, got_res) = _fused(norm, x), _fused(norm, x, r)
    parts = [_compare(ref, got, dtype), _compare(ref2, got2, dtype),
             _compare(ref_res, got_res, dtype)]
    return {"err": max(p["err"] for p in parts), "ok": all(p["ok"] for p in parts)}


def _fused(norm: RMSNorm, x: torch.Tensor, r: torch.Tensor | None = None):
    from engine.kernels.fused import rmsnorm

    return rmsnorm(x, norm.weight, norm.eps, r)


def check_silu_and_mul(rows: int, d: int, dtype: torch.dtype, seed: int) -> dict:
    from engine.kernels.fused import silu_and_mul

    torch.manual_seed(seed)
    x = torch.randn(_small(rows), 2 * d, dtype=dtype, device=DEVICE) * 3
    return _compare(SiluAndMul()(x), silu_and_mul(x), dtype)


def check_rope(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int,
               qk_norm: bool = False) -> dict:
    """q and k as the attention layer has them: strided views into one fused QKV output;
    with `qk_norm`, Qwen3's per-head q and k RMSNorms first (fused into the same kernel)."""
    from engine.kernels.fused import rope

    torch.manual_seed(seed)
    # One program per token and head block, and nothing masked along tokens: under the
    # interpreter a dozen tokens exercise what forty do (the 16-head blocks of launches of
    # 64 tokens or more: test_rope_head_blocks_give_the_same_values).
    t = _small(t, cpu_cap=12)
    with torch.device(DEVICE):
        emb = RotaryEmbedding(d, 4096, {"rope_theta": 500000.0, "rope_type": "default"})
    qkv = torch.randn(t, (hq + 2 * hkv) * d, dtype=dtype, device=DEVICE)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    pos = torch.randint(0, 4096, (t,), device=DEVICE)
    norms = None
    if qk_norm:
        norms = tuple(RMSNorm(d, 1e-6).to(device=DEVICE) for _ in range(2))
        for norm in norms:
            norm.weight.data = torch.randn(d, device=DEVICE)
            norm.to(dtype)
    ref_q, ref_k = emb(pos, q, k, norms)
    got_q, got_k = rope(pos, q, k, emb.cos_sin_cache,
                        None if norms is None else (norms[0].weight, norms[1].weight, 1e-6))
    a, b = _compare(ref_q, got_q, dtype), _compare(ref_k, got_k, dtype)
    return {"err": max(a["err"], b["err"]), "ok": a["ok"] and b["ok"]}


def all_fused_checks() -> list[tuple[str, dict]]:
    rows = []
    for dt in ("bf16", "fp16", "fp32"):
        for i, (n, h) in enumerate(ROWS):
            rows.append((f"fused/rmsnorm_{n}x{h}_{dt}", check_rmsnorm(n, h, DT[dt], i)))
            rows.append((f"fused/silu_mul_{n}x{h}_{dt}", check_silu_and_mul(n, h, DT[dt], i)))
        for i, shape in enumerate(ROPE):
            rows.append((f"fused/rope_{'x'.join(map(str, shape))}_{dt}",
                         check_rope(*shape, DT[dt], i)))
            rows.append((f"fused/qk_norm_rope_{'x'.join(map(str, shape))}_{dt}",
                         check_rope(*shape, DT[dt], i, qk_norm=True)))
    return rows


@pytest.mark.parametrize("dt", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", ROWS)
def test_rmsnorm(shape, dt):
    r = check_rmsnorm(*shape, DT[dt], 0)
    assert r["ok"], r


@pytest.mark.parametrize("dt", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", ROWS)
def test_silu_and_mul(shape, dt):
    r = check_silu_and_mul(*shape, DT[dt], 1)
    assert r["ok"], r


@pytest.mark.parametrize("dt", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", ROPE)
def test_rope(shape, dt):
    r = check_rope(*shape, DT[dt], 2)
    assert r["ok"], r


@pytest.mark.parametrize("dt", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", ROPE)
def test_qk_norm_then_rope(shape, dt):
    r = check_rope(*shape, DT[dt], 3, qk_norm=True)
    assert r["ok"], r


@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk_norm_rope"])
def test_rope_head_blocks_give_the_same_values(qk_norm):
    """Prefill-sized launches take blocks of 16 heads (4 with the per-head norm, whose sums
    the block shape would reorder), decode-sized ones blocks of 4: the same values, bit for
    bit (70 tokens at once against each token alone)."""
    from engine.kernels.fused import rope

    torch.manual_seed(4)
    t, hq, hkv, d = 70, 12, 4, 64
    with torch.device(DEVICE):
        emb = RotaryEmbedding(d, 4096, {"rope_theta": 10000.0, "rope_type": "default"})
    q = torch.randn(t, hq, d, device=DEVICE)
    k = torch.randn(t, hkv, d, device=DEVICE)
    pos = torch.randint(0, 4096, (t,), device=DEVICE)
    norm = (torch.randn(d, device=DEVICE), torch.randn(d, device=DEVICE), 1e-6) if qk_norm else None
    all_q, all_k = rope(pos, q, k, emb.cos_sin_cache, norm)
    for i in (0, 33, 69):
        one_q, one_k = rope(pos[i:i + 1], q[i:i + 1], k[i:i + 1], emb.cos_sin_cache, norm)
        assert torch.equal(one_q[0], all_q[i]) and torch.equal(one_k[0], all_k[i])


def _same_quantized(got, ref: torch.Tensor) -> None:
    """`got` (Fp8Rows) holds the bits the linear's own quantizer makes of `ref`. For float32
    rows only to within float32 rounding: on the H200 a fused norm's float32 output differed
    from the stored one in the last bit on a few rows (their scales 1 ulp apart, no float8
    code changed); bf16 and fp16 rows, what FP8 models serve in, are checked bit for bit."""
    from engine.kernels.fp8_format import Fp8Rows
    from engine.kernels.fp8 import quantize_rows

    assert isinstance(got, Fp8Rows) and got.dtype == ref.dtype
    q, scale = quantize_rows(ref.reshape(-1, ref.shape[-1]))
    rows = (got.scale != scale).flatten().nonzero().flatten().tolist()
    codes = (got.q.view(torch.uint8) != q.view(torch.uint8)).sum().item()
    if ref.dtype == torch.float32:
        torch.testing.assert_close(got.scale, scale, rtol=3e-7, atol=0)
        assert codes <= got.q.numel() // 1000, codes
        return
    assert not rows and not codes, (f"scales of rows {rows[:8]} differ (e.g. {got.scale[rows[:1]]} "
                                    f"vs {scale[rows[:1]]}), {codes} codes differ")


@pytest.mark.parametrize("dt", ["bf16", "fp32"])
@pytest.mark.parametrize("rows, hidden", [(17, 4096), (40, 96), (300, 5120)])
def test_rmsnorm_quantizing_gives_the_linears_bits(rows, hidden, dt):
    """With `quantize` the norm hands an FP8 linear its input as float8 rows + scales: the
    same bits as the unquantized norm's output through the linear's own quantizer, and the
    same residual stream."""
    from engine.kernels.fused import rmsnorm

    torch.manual_seed(5)
    rows, dtype = _small(rows), DT[dt]
    weight = torch.randn(hidden, device=DEVICE).to(dtype)
    x = torch.randn(rows, hidden, device=DEVICE).to(dtype) * 4
    x[0] = 0  # an all-zero row takes the smallest scale
    r = torch.randn(rows, hidden, device=DEVICE).to(dtype)
    _same_quantized(rmsnorm(x, weight, 1e-5, quantize=True), rmsnorm(x, weight, 1e-5))
    got, got_res = rmsnorm(x, weight, 1e-5, r, quantize=True)
    ref, ref_res = rmsnorm(x, weight, 1e-5, r)
    _same_quantized(got, ref)
    assert torch.equal(got_res, ref_res)


@pytest.mark.parametrize("dt", ["bf16", "fp32"])
@pytest.mark.parametrize("rows, d", [(17, 14336), (40, 96), (300, 2000)])
def test_silu_and_mul_quantizing_gives_the_linears_bits(rows, d, dt):
    from engine.kernels.fused import QUANTIZE_MAX_WIDTH, silu_and_mul

    torch.manual_seed(6)
    x = torch.randn(_small(rows), 2 * d, device=DEVICE).to(DT[dt]) * 3
    _same_quantized(silu_and_mul(x, quantize=True), silu_and_mul(x))
    wide = torch.randn(2, 2 * (QUANTIZE_MAX_WIDTH + 8), device=DEVICE).to(DT[dt])
    assert torch.equal(silu_and_mul(wide, quantize=True), silu_and_mul(wide))  # left to the linear


def test_layers_dispatch_only_on_gpu_tensors():
    """The switch never sends CPU tensors to Triton (CPU engines keep the torch path)."""
    norm = RMSNorm(8)
    norm.fused = True
    x = torch.randn(2, 8)
    assert torch.equal(norm(x), RMSNorm(8)(x))
