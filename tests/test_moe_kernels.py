"""The Triton MoE path (grouped GEMMs) against the torch reference (GPU only).

Marked `gpu` and skipped without CUDA; with `TRITON_INTERPRET=1` the same tests run on the
CPU through Triton's interpreter (small shapes), which tests/test_moe.py does in CI.
"""
from __future__ import annotations

import os

import pytest
import torch

from engine.kernels.moe import pairs as moe_pair_kernels
from engine.layers.moe import experts_torch, experts_triton
from engine.kernels.moe.pairs import experts_per_pair
from engine.kernels.tiles import Tiles
from engine.kernels.moe.router import softmax_topk
from engine.kernels.moe.align import group_by_expert_kernel
from engine.kernels.moe.router import select_experts
from engine.kernels.moe.routing import group_by_expert

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else ("cpu" if INTERPRET else None)
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU (or TRITON_INTERPRET=1)")]

# (tokens, experts, top_k, hidden, intermediate): decode-sized (the per-pair path), a prefill
# with more pairs than one block per expert (grouped), widths not multiples of the tiles.
CASES = [(1, 8, 2, 64, 32), (3, 16, 4, 48, 40), (70, 8, 2, 32, 24), (600, 4, 1, 32, 24)]  # the last: blocks of 128
# Qwen3-30B-A3B's expert shapes at decode and prefill batch sizes (too slow to interpret).
GPU_CASES = [(1, 128, 8, 2048, 768), (8, 128, 8, 2048, 768), (256, 128, 8, 2048, 768),
             (4096, 128, 8, 2048, 768)]
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def random_moe(t: int, e: int, k: int, h: int, i: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=g) / i ** 0.5
    weights, ids = select_experts(torch.randn(t, e, generator=g) * 2, k, renormalize=True)
    to = dict(device=DEVICE, dtype=dtype)
    return x.to(**to), w13.to(**to), w2.to(**to), weights.to(DEVICE), ids.to(DEVICE)


def check_moe(case: tuple, dtype: torch.dtype, seed: int = 0) -> dict:
    """The Triton path against the fp32 torch reference on one random case."""
    x, w13, w2, weights, ids = random_moe(*case, dtype, seed=seed)
    ref = experts_torch(x.float(), w13.float(), w2.float(), weights, ids)
    out = experts_triton(x, w13, w2, weights, ids)
    err = (out.float() - ref).abs().max().item()
    ok = out.dtype == dtype and out.shape == ref.shape and err <= TOL[dtype] * (1 + ref.abs().max().item())
    return {"ok": ok, "max_err": err}


def all_moe_checks() -> list[tuple[str, dict]]:
    """Every case, bf16 and fp32, for scripts/bench_offline.py's kernel check (GPU)."""
    return [(f"moe/{'x'.join(map(str, case))}_{dt}".replace("torch.", ""), check_moe(case, dt, i))
            for i, case in enumerate(CASES + GPU_CASES) for dt in (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if not INTERPRET else []))
@pytest.mark.parametrize("case", CASES + ([] if INTERPRET else GPU_CASES), ids=lambda c: "x".join(map(str, c)))
def test_grouped_gemm_matches_reference(case, dtype):
    r = check_moe(case, dtype)
    assert r["ok"], r


@pytest.mark.parametrize("path", ["per_pair", "grouped"])
@pytest.mark.parametrize("rank", [0, 1])
def test_expert_parallel_slices_add_up(rank, path, monkeypatch):
    """Each rank's half of the experts gives its share; the shares add up to the whole."""
    if path == "grouped":  # 18 pairs would take the per-pair path
        monkeypatch.setattr(moe_pair_kernels, "MAX_PAIRS", 0)
    x, w13, w2, weights, ids = random_moe(9, 8, 2, 32, 16, torch.float32, seed=1)
    half = slice(4 * rank, 4 * rank + 4)
    ours = experts_triton(x, w13[half].contiguous(), w2[half].contiguous(), weights, ids,
                          first_expert=4 * rank)
    ref = experts_torch(x, w13[half], w2[half], weights, ids, first_expert=4 * rank)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    other = slice(4 * (1 - rank), 4 * (1 - rank) + 4)
    rest = experts_torch(x, w13[other], w2[other], weights, ids, first_expert=4 * (1 - rank))
    torch.testing.assert_close(ours + rest, experts_torch(x, w13, w2, weights, ids),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("config", [Tiles(16, 256), Tiles(block_n=32, block_k=32, num_warps=2)],
                         ids=["default", "small_tiles"])
def test_per_pair_path_any_tiling(config):
    """Tiles that do not divide the widths, and a token whose choices share an expert."""
    x, w13, w2, weights, ids = random_moe(3, 8, 4, 48, 40, torch.float32, seed=2)
    ids[1] = torch.tensor([5, 5, 2, 5])  # as if the router picked one expert thrice
    ref = experts_torch(x, w13, w2, weights, ids)
    out = experts_per_pair(x, w13, w2, weights, ids, config=config, down_config=config)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if not INTERPRET else []))
@pytest.mark.parametrize("case", CASES + ([] if INTERPRET else GPU_CASES[:3]),
                         ids=lambda c: "x".join(map(str, c)))
def test_fp8_experts_match_the_dequantized_reference(case, dtype):
    """Float8 expert weights with per-row scales (FP8 MoE models, W8A16) through both Triton
    paths (per pair at decode sizes, grouped above) against `experts_torch` on the same
    weights dequantized; expert parallelism's half-slices too (first_expert)."""
    from engine.quantization.fp8 import quantize_rows

    x, w13, w2, weights, ids = random_moe(*case, dtype, seed=7)
    q13, s13 = quantize_rows(w13.float().reshape(-1, w13.shape[-1]))
    q2, s2 = quantize_rows(w2.float().reshape(-1, w2.shape[-1]))
    q13, q2 = q13.view(w13.shape), q2.view(w2.shape)
    s13, s2 = s13.view(*w13.shape[:2], 1), s2.view(*w2.shape[:2], 1)
    ref = experts_torch(x.float(), q13.float() * s13, q2.float() * s2, weights, ids)
    out = experts_triton(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    assert (out.float() - ref).abs().max().item() <= TOL[dtype] * (1 + ref.abs().max().item())
    half = case[1] // 2  # the second half of the experts, as rank 1 of two holds them
    ref = experts_torch(x.float(), q13[half:].float() * s13[half:], q2[half:].float() * s2[half:],
                        weights, ids, first_expert=half)
    out = experts_triton(x, q13[half:], q2[half:], weights, ids, first_expert=half,
                         w13_scale=s13[half:].contiguous(), w2_scale=s2[half:].contiguous())
    assert (out.float() - ref).abs().max().item() <= TOL[dtype] * (1 + ref.abs().max().item())


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 128, 8), (5, 60, 4), (3, 8, 2)])
def test_softmax_topk_kernel_matches_select_experts(tokens, experts, top_k, renormalize):
    g = torch.Generator().manual_seed(tokens)
    logits = (torch.randn(tokens, experts, generator=g) * 3).to(DEVICE)
    weights, ids = softmax_topk(logits, top_k, renormalize)
    ref_probs = torch.softmax(logits.float().cpu(), dim=-1)
    ref_w, ref_ids = torch.topk(ref_probs, top_k, dim=-1)
    if renormalize:
        ref_w = ref_w / ref_w.sum(dim=-1, keepdim=True)
    assert ids.dtype == torch.int64 and torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_w, atol=1e-6, rtol=1e-5)
    if DEVICE == "cuda":  # what the model calls on the GPU is the kernel
        w2, i2 = select_experts(logits.bfloat16(), top_k, renormalize)
        assert torch.equal(i2, softmax_topk(logits.bfloat16(), top_k, renormalize)[1])


@pytest.mark.parametrize("experts", [8, 60])
def test_softmax_topk_ids_stay_in_range_on_nan_logits(experts):
    """NaN router logits (a deferred compile pass's unwritten buffer, engine/kernels/precompile.py,
    or an overflowing model) must still give expert ids below the expert count: they index
    the experts' weights."""
    logits = torch.full((3, experts), float("nan"), device=DEVICE)
    logits[1, :2] = 1.0  # a row with a few numbers among the NaNs
    _, ids = softmax_topk(logits, 4, renormalize=True)
    assert int(ids.min()) >= 0 and int(ids.max()) < experts, ids


@pytest.mark.parametrize("tokens,experts,top_k,block_m,first,num_local", [
    (1, 128, 8, 16, 0, 128), (37, 8, 2, 16, 0, 8), (300, 16, 4, 32, 4, 8), (70, 8, 2, 64, 0, 8),
    (5, 6, 2, 16, 3, 3), (1100, 128, 8, 64, 0, 128), (700, 4, 1, 128, 0, 4)], ids=lambda v: str(v))
def test_align_kernel_equals_torch_grouping(tokens, experts, top_k, block_m, first, num_local):
    """The kernels' grouping gives the torch version's rows in the same order (EP ranks,
    blocks of 16-128, experts left empty, one chunk of 128 pairs and more chunks than the
    offsets program sums at once)."""
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(DEVICE)
    ref = group_by_expert(ids, num_local, first, block_m)
    ours = group_by_expert_kernel(ids, num_local, first, block_m)
    assert torch.equal(ours.sorted_pairs, ref.sorted_pairs)
    assert torch.equal(ours.block_expert, ref.block_expert)
