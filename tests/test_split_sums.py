"""A GEMV's K-slice partial sums added by the kernel that consumes them
(engine/kernels/split_sums.py): RMSNorm (+ residual), SiLU-and-mul, RoPE (with Qwen3's q/k
norms; v summed too) and the MoE router give exactly what they give on the GEMV's own
summed output; an RMSNorm adds the MoE experts' choices as `sum_choices` does.

The `gpu` tests also run on the CPU under TRITON_INTERPRET=1 (from
tests/test_split_sums_cpu.py); the layers' torch fallbacks are checked on the CPU here.
"""
from __future__ import annotations

import pytest
import torch

from engine.layers.activation import SiluAndMul
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.kernels.split_sums import SplitSums
from test_triton_attention import DEVICE

# The interpreter's bf16 rounding is not torch's, so on the CPU both sides of a comparison
# round in kernels: the reference is the GEMV's own summing launch (`sum_splits`).
DTYPES = [torch.bfloat16, torch.float32]
ROPE = [(1, 32, 8, 128), (3, 4, 2, 64)]  # (tokens, q heads, kv heads, head dim)


def on_device(test):
    test = pytest.mark.gpu(test)
    return pytest.mark.skipif(DEVICE is None, reason="needs CUDA or TRITON_INTERPRET=1")(test)


def _split_sums(splits: int, rows: int, n: int, dtype: torch.dtype, seed: int,
                device=None) -> SplitSums:
    g = torch.Generator().manual_seed(seed)
    return SplitSums(torch.randn(splits, rows, n, generator=g).to(device or DEVICE), dtype)


def _summed(s: SplitSums) -> torch.Tensor:
    from engine.kernels.gemv import sum_splits

    return sum_splits(s.parts, s.dtype)


@on_device
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("splits", [2, 4, 6])
def test_gemv_hands_back_its_splits(splits, dtype):
    from engine.kernels.gemv import gemv
    from engine.kernels.tiles import Tiles

    g = torch.Generator().manual_seed(splits)
    x = torch.randn(1, 768, generator=g).to(DEVICE, dtype)
    w = (torch.randn(96, 768, generator=g) / 768 ** 0.5).to(DEVICE, dtype)
    tiles = Tiles(32, 64, split_k=splits)
    kept = gemv(x, w, None, tiles, keep_splits=True)
    assert isinstance(kept, SplitSums) and kept.splits == splits and kept.shape == (1, 96)
    assert torch.equal(_summed(kept), gemv(x, w, None, tiles))
    assert isinstance(gemv(x, w, None, Tiles(32, 64), keep_splits=True), torch.Tensor)  # one slice


@on_device
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, n", [(1, 4096), (3, 96)])
def test_rmsnorm_adds_the_splits(rows, n, dtype):
    from engine.kernels.fused import rmsnorm

    s = _split_sums(4, rows, n, dtype, seed=n)
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(n, generator=g).to(DEVICE, dtype)
    residual = torch.randn(rows, n, generator=g).to(DEVICE, dtype)
    assert torch.equal(rmsnorm(s, weight, 1e-5), rmsnorm(_summed(s), weight, 1e-5))
    got, got_res = rmsnorm(s, weight, 1e-5, residual)
    ref, ref_res = rmsnorm(_summed(s), weight, 1e-5, residual)
    assert torch.equal(got, ref) and torch.equal(got_res, ref_res)


@on_device
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, d", [(1, 14336), (3, 96)])
def test_silu_and_mul_adds_the_splits(rows, d, dtype):
    from engine.kernels.fused import silu_and_mul

    s = _split_sums(3, rows, 2 * d, dtype, seed=d)
    assert torch.equal(silu_and_mul(s), silu_and_mul(_summed(s)))


@on_device
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk_norm_rope"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ROPE, ids=lambda s: "x".join(map(str, s)))
def test_rope_adds_the_splits(shape, dtype, qk_norm):
    from engine.kernels.fused import rope, rope_split_sums

    t, hq, hkv, d = shape
    with torch.device(DEVICE):
        emb = RotaryEmbedding(d, 4096, {"rope_theta": 500000.0, "rope_type": "default"})
    s = _split_sums(4, t, (hq + 2 * hkv) * d, dtype, seed=hq)
    g = torch.Generator().manual_seed(2)
    pos = torch.randint(0, 4096, (t,), generator=g).to(DEVICE)
    norm = (torch.randn(d, generator=g).to(DEVICE, dtype), torch.randn(d, generator=g).to(DEVICE, dtype),
            1e-6) if qk_norm else None
    q, k, v = rope_split_sums(pos, s, (hq, hkv, d), emb.cos_sin_cache, norm)
    qkv = _summed(s)
    ref_q, ref_k = rope(pos, qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d),
                        emb.cos_sin_cache, norm)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(v, qkv[:, (hq + hkv) * d:].view(t, hkv, d))


@on_device
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_router_adds_the_splits(dtype):
    from engine.kernels.moe.router import softmax_topk

    s = _split_sums(4, 3, 128, dtype, seed=5)
    for renormalize in (False, True):
        got = softmax_topk(s, 8, renormalize)
        ref = softmax_topk(_summed(s), 8, renormalize)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@on_device
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 2])
def test_rmsnorm_adds_the_expert_choices(tokens, dtype):
    """The MoE experts' k weighted outputs per token, left unsummed for the next RMSNorm,
    give what `sum_choices` and then the norm give."""
    from engine.kernels.fused import rmsnorm
    from engine.kernels.moe.pairs import experts_per_pair
    from engine.kernels.moe.router import softmax_topk

    g = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, top_k = 16, 256, 96, 4
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(DEVICE, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(DEVICE, dtype)
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE, dtype)
    weights, ids = softmax_topk(torch.randn(tokens, experts, generator=g).to(DEVICE), top_k, True)
    summed = experts_per_pair(x, w13, w2, weights, ids)
    kept = experts_per_pair(x, w13, w2, weights, ids, keep_choices=True)
    assert isinstance(kept, SplitSums) and kept.splits == top_k and kept.shape == (tokens, hidden)
    norm_w = torch.randn(hidden, generator=g).to(DEVICE, dtype)
    residual = torch.randn(tokens, hidden, generator=g).to(DEVICE, dtype)
    got, got_res = rmsnorm(kept, norm_w, 1e-6, residual)
    ref, ref_res = rmsnorm(summed, norm_w, 1e-6, residual)
    assert torch.equal(got, ref) and torch.equal(got_res, ref_res)


def test_total_adds_in_split_order():
    """The torch fallback: float32 adds in split order, one rounding (what the kernel does)."""
    s = _split_sums(5, 2, 64, torch.bfloat16, seed=0, device="cpu")
    acc = torch.zeros(2, 64)
    for part in s.parts:
        acc = acc + part
    assert torch.equal(s.total(), acc.bfloat16())
    parts = s.parts.clone()
    assert torch.equal(SplitSums(parts, torch.float32).total(), acc) and torch.equal(parts, s.parts)
    choices = s.parts.bfloat16()  # bf16 parts (the MoE choices): added in float32 too
    acc = torch.zeros(2, 64)
    for part in choices:
        acc = acc + part.float()
    assert torch.equal(SplitSums(choices, torch.bfloat16).total(), acc.bfloat16())


def test_layers_take_split_sums_without_kernels():
    """Unfused layers (CPU tensors, or fused kernels off) sum first and go on as before."""
    torch.manual_seed(0)
    s = _split_sums(3, 2, 2 * 48, torch.float32, seed=1, device="cpu")
    total = s.total()
    norm = RMSNorm(96)
    norm.weight.data = torch.randn(96)
    residual = torch.randn(2, 96)
    assert torch.equal(norm(s), norm(total))
    assert all(torch.equal(a, b) for a, b in zip(norm(s, residual), norm(total, residual)))
    assert torch.equal(SiluAndMul()(s), SiluAndMul()(total))
    emb = RotaryEmbedding(16, 64, {"rope_theta": 10000.0, "rope_type": "default"})
    pos = torch.tensor([3, 9])
    qkv = _split_sums(3, 2, (4 + 2 * 2) * 16, torch.float32, seed=2, device="cpu")
    q, k, v = emb.forward_split_sums(pos, qkv, (4, 2, 16))
    flat = qkv.total()
    ref_q, ref_k = emb(pos, flat[:, :64].view(2, 4, 16), flat[:, 64:96].view(2, 2, 16))
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(v, flat[:, 96:].view(2, 2, 16))
