"""Top-k / top-p / min-p without sorting the vocabulary: each row's cut as a threshold.

Sorting every row's probabilities costs 0.5-1.1 ms at one row and 8.5 ms at 512 rows of a 128k
vocabulary on the H200; this cut takes 0.2-0.5 and 1.7 (top-p) to 3.1 ms (top-k and top-p),
and the sampler takes it for every float32 batch on a GPU. Each of the three filters keeps the
tokens at or above a value, so their intersection is one threshold per row, the largest of:
- min-p: min_p x the row's maximum;
- top-k: the k-th largest value, i.e. the smallest float t with count(p > t) < k;
- top-p: the smallest t with mass(p > t) < top_p (a token is kept when the mass strictly
  above it is below top_p, as the sorted cumulative sum keeps it).
Non-negative floats order as their int32 bit patterns, so t is searched over bits: each pass
over the rows counts (and weighs) the values above PIVOTS candidates spread over the interval
still open, and keeps the one gap where the condition turns; PASSES pin it exactly.
Ties at the cut are all kept (a sort keeps an arbitrary part of them).

A pass is one launch over (row, chunk) programs, so a single row still fills the GPU. Each
program writes its chunk's counts and masses; the next pass's programs sum a row's chunks in a
fixed order (deterministic, unlike atomics: a seeded request samples the same tokens on every
run) and narrow the interval themselves. Passes alternate between two scratch slots.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import pdl_launch, pdl_prologue

# Candidates per pass: 16 (8 passes) where few rows leave the launches' host time to
# dominate, 8 (11 passes, half the comparisons) from MANY_ROWS on, where the GPU's
# arithmetic does (H200, 128k vocabulary: top-p at 512 rows 1.7 ms against 2.3 with 16)
PIVOTS, MANY_ROWS_PIVOTS, MANY_ROWS = 16, 8, 128
CHUNK = 8192  # of a row's values, per program and pass
BLOCK = 256


def passes_for(pivots: int) -> int:
    """Passes that pin the cut to one bit pattern: the interval starts as every pattern up to
    +inf's, and a pass leaves one gap between candidates (d -> ceil((d - 1) / (pivots - 1)))."""
    size, passes = 0x7F800001, 0
    while size > 1:
        size, passes = -(-(size - 1) // (pivots - 1)), passes + 1
    return passes


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
def _interval(State, Stat, slot, row, rows, nchunk, limit, SIDE: tl.constexpr,
              NCHUNK: tl.constexpr, PIVOTS: tl.constexpr):
    """The interval [lo, hi] of top-k's (SIDE 0) or top-p's (SIDE 1) search after the pass
    that wrote scratch `slot`: that pass's interval narrowed by its chunks' statistics."""
    j = tl.arange(0, PIVOTS)
    c = tl.arange(0, NCHUNK)
    at = (slot * rows + row) * 4 + 2 * SIDE
    lo = tl.load(State + at)
    hi = tl.load(State + at + 1)
    parts = Stat + ((slot * rows + row) * nchunk + c[:, None]) * PIVOTS + j[None, :]
    above = tl.sum(tl.load(parts, mask=c[:, None] < nchunk, other=0), axis=0)
    return _narrow(lo, hi, _candidates(lo, hi, j, PIVOTS), above, limit, j, PIVOTS)


# rows, step, slot and nchunk vary per call, and the sampler's parameters come from a staging
# ring at any offset: one binary for all (Triton would otherwise compile again for the value
# 1, for multiples of 16 and for 16-byte aligned pointers)
@triton.jit(do_not_specialize=["rows", "nchunk", "step"],
            do_not_specialize_on_alignment=["TopK", "TopP"])
def _pass_kernel(P, TopK, TopP, State, Count, Mass, ChunkMax, V, stride_p, rows, nchunk, step,
                 NCHUNK: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                 PIVOTS: tl.constexpr, FIND_K: tl.constexpr, FIND_P: tl.constexpr,
                 PDL: tl.constexpr = False):
    """Pass `step` over chunk program_id(1) of row program_id(0): statistics of the values
    above each candidate into scratch slot step % 2; pass 0 also keeps the chunk's maximum."""
    pdl_prologue(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    j = tl.arange(0, PIVOTS)
    slot = step % 2
    lo_k = step * 0
    hi_k = lo_k + 0x7F800000  # +inf's bits: no finite probability lies above them
    lo_p, hi_p = lo_k, hi_k
    if step > 0:
        if FIND_K:
            lo_k, hi_k = _interval(State, Count, 1 - slot, row, rows, nchunk, tl.load(TopK + row),
                                   0, NCHUNK, PIVOTS)
        if FIND_P:
            lo_p, hi_p = _interval(State, Mass, 1 - slot, row, rows, nchunk, tl.load(TopP + row),
                                   1, NCHUNK, PIVOTS)
    cand_k = _candidates(lo_k, hi_k, j, PIVOTS)
    cand_p = _candidates(lo_p, hi_p, j, PIVOTS)
    count = tl.zeros([BLOCK, PIVOTS], tl.int32)  # reduced once, after the loop
    mass = tl.zeros([BLOCK, PIVOTS], tl.float32)
    peak = tl.zeros([BLOCK], tl.float32)
    offs = chunk * CHUNK + tl.arange(0, BLOCK)
    base = P + row.to(tl.int64) * stride_p
    for start in range(0, tl.minimum(CHUNK, V - chunk * CHUNK), BLOCK):
        x = tl.load(base + start + offs, mask=start + offs < V, other=0.0)
        bits = x.to(tl.int32, bitcast=True)
        if FIND_K:
            count += (bits[:, None] > cand_k[None, :]).to(tl.int32)
        if FIND_P:
            mass += tl.where(bits[:, None] > cand_p[None, :], x[:, None], 0.0)
        peak = tl.maximum(peak, x)
    out = ((slot * rows + row) * nchunk + chunk) * PIVOTS + j
    if FIND_K:
        tl.store(Count + out, tl.sum(count, axis=0))
    if FIND_P:
        tl.store(Mass + out, tl.sum(mass, axis=0))
    if step == 0:
        tl.store(ChunkMax + row * nchunk + chunk, tl.max(peak, axis=0))
    if chunk == 0:  # the interval this pass searched, for the next one to narrow
        at = State + (slot * rows + row) * 4
        tl.store(at, lo_k)
        tl.store(at + 1, hi_k)
        tl.store(at + 2, lo_p)
        tl.store(at + 3, hi_p)


@triton.jit(do_not_specialize=["rows", "nchunk", "slot"],
            do_not_specialize_on_alignment=["TopK", "TopP", "MinP"])
def _cut_kernel(TopK, TopP, MinP, State, Count, Mass, ChunkMax, Cut, V, rows, nchunk, slot,
                NCHUNK: tl.constexpr, PIVOTS: tl.constexpr, FIND_K: tl.constexpr,
                FIND_P: tl.constexpr, PDL: tl.constexpr = False):
    """Row program_id(0)'s threshold, from the last pass (scratch `slot`) and pass 0's maxima."""
    pdl_prologue(PDL)
    row = tl.program_id(0)
    c = tl.arange(0, NCHUNK)
    pmax = tl.max(tl.load(ChunkMax + row * nchunk + c, mask=c < nchunk, other=0.0), axis=0)
    cut = tl.load(MinP + row) * pmax
    if FIND_K:
        k = tl.load(TopK + row)
        _, hi_k = _interval(State, Count, slot, row, rows, nchunk, k, 0, NCHUNK, PIVOTS)
        cut = tl.where(k < V, tl.maximum(cut, hi_k.to(tl.float32, bitcast=True)), cut)
    if FIND_P:
        top_p = tl.load(TopP + row)
        _, hi_p = _interval(State, Mass, slot, row, rows, nchunk, top_p, 1, NCHUNK, PIVOTS)
        cut = tl.where(top_p < 1.0, tl.maximum(cut, hi_p.to(tl.float32, bitcast=True)), cut)
    tl.store(Cut + row, cut)


def sampling_cut(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, find_k: bool = True, find_p: bool = True) -> torch.Tensor:
    """[B] float32 thresholds: row b keeps the tokens with probs[b] >= cut[b]. probs [B, V]
    float32 (non-negative, finite); top_k [B] int32 (>= V: off), top_p [B] float32 (>= 1:
    off), min_p [B] float32 (0: off). `find_k` / `find_p` False: no row uses top-k / top-p
    (the passes skip that search; min-p alone takes one pass, for the maxima)."""
    rows, vocab = probs.shape
    probs = probs.contiguous()
    dev = probs.device
    nchunk = triton.cdiv(vocab, CHUNK)
    pivots = MANY_ROWS_PIVOTS if rows >= MANY_ROWS else PIVOTS
    fixed = dict(NCHUNK=triton.next_power_of_2(nchunk), PIVOTS=pivots, FIND_K=find_k,
                 FIND_P=find_p, **pdl_launch(dev))
    state = torch.empty((2, rows, 4), dtype=torch.int32, device=dev)
    count = torch.empty((2, rows, nchunk, pivots), dtype=torch.int32, device=dev)
    mass = torch.empty((2, rows, nchunk, pivots), dtype=torch.float32, device=dev)
    chunk_max = torch.empty((rows, nchunk), dtype=torch.float32, device=dev)
    cut = torch.empty(rows, dtype=torch.float32, device=dev)
    passes = passes_for(pivots) if find_k or find_p else 1
    for step in range(passes):
        _pass_kernel[(rows, nchunk)](probs, top_k, top_p, state, count, mass, chunk_max, vocab,
                                     probs.stride(0), rows, nchunk, step, CHUNK=CHUNK,
                                     BLOCK=BLOCK, **fixed)
    _cut_kernel[(rows,)](top_k, top_p, min_p, state, count, mass, chunk_max, cut, vocab, rows,
                         nchunk, (passes - 1) % 2, **fixed)
    return cut


def compile_variants(vocab: int, device: torch.device) -> None:
    """Launch each variant of the cut once (top-k and top-p, either alone, or min-p alone,
    with few and with many rows' candidates) on the served vocabulary: the engine's warm-up
    (engine/runtime/warmup.py), so the first sampled batch compiles nothing."""
    for rows in (1, MANY_ROWS):
        probs = torch.full((rows, vocab), 1.0 / vocab, device=device)
        top_k = torch.full((rows,), vocab, dtype=torch.int32, device=device)
        top_p = torch.ones(rows, device=device)
        min_p = torch.zeros(rows, device=device)
        for find_k, find_p in ((True, True), (True, False), (False, True), (False, False)):
            sampling_cut(probs, top_k, top_p, min_p, find_k, find_p)
