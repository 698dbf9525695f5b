"""Top-k / top-p / min-p without sorting the vocabulary: each row's cut as a threshold.

The sort-based filter (engine/sampler.py) sorts every row's probabilities: 8.4 ms a step at
512 rows of a 128k vocabulary on the H200, against 1 ms for the rest of sampling; this cut
took 5.6 (top-p), 3.9 (top-k) and 1.6 ms (min-p) there, but one program per row makes it
slower than the sort at small batches (1.9 vs 0.9 ms for top-p at one row), so the sampler
picks (`engine.sampler.takes_the_cut`). Each of
the three filters keeps the tokens at or above a value, so their intersection is one
threshold per row, the largest of three:
- min-p: min_p x the row's maximum;
- top-k: the k-th largest value, i.e. the smallest float t with count(p > t) < k;
- top-p: the smallest t with mass(p > t) < top_p (a token is kept when the mass strictly
  above it is below top_p, as the sorted cumulative sum keeps it).
Non-negative floats order as their int32 bit patterns, so t is searched over bits: each pass
over the row counts (and weighs) the values above PIVOTS candidates spread over the interval
still open, and keeps the one gap where the condition turns; ~8 passes pin it exactly.
Ties at the cut are all kept (a sort keeps an arbitrary part of them).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.layers.pdl import pdl_launch, pdl_prologue

PIVOTS = 16
PASSES = 9  # 2^30 bit patterns (values <= 1.0) shrink to one: d -> ceil(d / 15) - 1
BLOCK = 512


@triton.jit
def _narrow(lo, hi, cand, above, limit, j, PIVOTS: tl.constexpr):
    """The open interval [lo, hi] after one pass: hi stays a candidate whose statistic is
    below `limit`, lo the first bit pattern past the last candidate at or above it."""
    ok = above < limit
    first = tl.min(tl.where(ok, j, PIVOTS), axis=0)
    new_hi = tl.sum(tl.where(j == first, cand, 0), axis=0)
    before = tl.sum(tl.where(j == first - 1, cand, 0), axis=0)
    new_lo = tl.where(first > 0, before + 1, lo)
    return new_lo, new_hi


@triton.jit
def _candidates(lo, hi, j, PIVOTS: tl.constexpr):
    step = (hi - lo + PIVOTS - 2) // (PIVOTS - 1)
    return tl.minimum(lo + j * step, hi)  # the last one is hi


@triton.jit
def _cut_kernel(P, TopK, TopP, MinP, Cut, V, stride_p, PIVOTS: tl.constexpr,
                PASSES: tl.constexpr, BLOCK: tl.constexpr, FIND_K: tl.constexpr,
                FIND_P: tl.constexpr, PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    row = tl.program_id(0)
    base = P + row.to(tl.int64) * stride_p
    offs = tl.arange(0, BLOCK)
    j = tl.arange(0, PIVOTS)
    peak = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        peak = tl.maximum(peak, tl.load(base + start + offs, mask=start + offs < V, other=0.0))
    pmax = tl.max(peak, axis=0)
    top_bits = pmax.to(tl.int32, bitcast=True)
    k = tl.load(TopK + row)
    top_p = tl.load(TopP + row)
    lo_k, hi_k = top_bits * 0, top_bits  # count(p > f(hi)) == 0 < k; mass == 0 < top_p
    lo_p, hi_p = top_bits * 0, top_bits
    for _ in tl.static_range(PASSES):
        cand_k = _candidates(lo_k, hi_k, j, PIVOTS)
        cand_p = _candidates(lo_p, hi_p, j, PIVOTS)
        count = tl.zeros([PIVOTS], tl.int32)
        mass = tl.zeros([PIVOTS], tl.float32)
        for start in range(0, V, BLOCK):
            x = tl.load(base + start + offs, mask=start + offs < V, other=0.0)
            bits = x.to(tl.int32, bitcast=True)
            if FIND_K:
                count += tl.sum((bits[:, None] > cand_k[None, :]).to(tl.int32), axis=0)
            if FIND_P:
                mass += tl.sum(tl.where(bits[:, None] > cand_p[None, :], x[:, None], 0.0), axis=0)
        if FIND_K:
            lo_k, hi_k = _narrow(lo_k, hi_k, cand_k, count, k, j, PIVOTS)
        if FIND_P:
            lo_p, hi_p = _narrow(lo_p, hi_p, cand_p, mass, top_p, j, PIVOTS)
    cut = tl.load(MinP + row) * pmax
    if FIND_K:
        cut = tl.where(k < V, tl.maximum(cut, hi_k.to(tl.float32, bitcast=True)), cut)
    if FIND_P:
        cut = tl.where(top_p < 1.0, tl.maximum(cut, hi_p.to(tl.float32, bitcast=True)), cut)
    tl.store(Cut + row, cut)


def sampling_cut(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, find_k: bool = True, find_p: bool = True) -> torch.Tensor:
    """[B] float32 thresholds: row b keeps the tokens with probs[b] >= cut[b]. probs [B, V]
    float32 (non-negative); top_k [B] int32 (>= V: off), top_p [B] float32 (>= 1: off),
    min_p [B] float32 (0: off). `find_k` / `find_p` False: no row uses top-k / top-p (the
    passes skip that search). One program per row."""
    rows, vocab = probs.shape
    probs = probs.contiguous()
    cut = torch.empty(rows, dtype=torch.float32, device=probs.device)
    _cut_kernel[(rows,)](probs, top_k, top_p, min_p, cut, vocab, probs.stride(0),
                         PIVOTS=PIVOTS, PASSES=PASSES, BLOCK=BLOCK, FIND_K=find_k, FIND_P=find_p,
                         **pdl_launch(probs.device))
    return cut


def compile_variants(vocab: int, device: torch.device) -> None:
    """Launch each variant of the cut once (top-k and top-p, either alone, or min-p alone)
    on one row of the served vocabulary: the engine's warm-up (engine/warmup.py), so the
    first large sampled batch compiles nothing."""
    probs = torch.full((1, vocab), 1.0 / vocab, device=device)
    top_k = torch.full((1,), vocab, dtype=torch.int32, device=device)
    top_p = torch.ones(1, device=device)
    min_p = torch.zeros(1, device=device)
    for find_k, find_p in ((True, True), (True, False), (False, True), (False, False)):
        sampling_cut(probs, top_k, top_p, min_p, find_k, find_p)
