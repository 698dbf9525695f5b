"""The sort-free top-k / top-p / min-p cut (engine/kernels/sampling_cut.py) keeps exactly the
tokens the sort-based filter keeps (engine/executor/sampler.py's reference), on rows without ties
near the cut. `gpu` tests also run on the CPU under TRITON_INTERPRET=1."""
from __future__ import annotations

import itertools

import pytest
import torch

from test_triton_attention import DEVICE


def on_device(test):
    test = pytest.mark.gpu(test)
    return pytest.mark.skipif(DEVICE is None, reason="needs CUDA or TRITON_INTERPRET=1")(test)


def _sorted_keep(probs, top_k, top_p, min_p):
    """The sort-based filter's kept tokens (as engine/executor/sampler.py computes them)."""
    vocab = probs.shape[1]
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab).unsqueeze(0)
    cum_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = (rank >= top_k.unsqueeze(1)) | (cum_before >= top_p.unsqueeze(1))
    drop |= sorted_probs < min_p.unsqueeze(1) * sorted_probs[:, :1]
    drop[:, 0] = False
    keep = torch.zeros_like(probs, dtype=torch.bool)
    return keep.scatter_(1, order, ~drop), cum_before, order


@on_device
@pytest.mark.parametrize("vocab,temperature,chunk,many", [
    (1000, 1.0, 8192, 128), (3000, 0.3, 8192, 128), (777, 3.0, 8192, 1), (1500, 1.0, 512, 1)])
def test_cut_keeps_what_the_sort_keeps(vocab, temperature, chunk, many, monkeypatch):
    """chunk 512: each row's passes spread over 3 programs, the last one partly masked (a 128k
    vocabulary's 16 chunks; the interpreter's time grows with the programs);
    many 1: the candidates of many rows (8 a pass) for these 10 rows."""
    import engine.kernels.sampling_cut as cut_module
    from engine.kernels.sampling_cut import sampling_cut

    monkeypatch.setattr(cut_module, "CHUNK", chunk)
    monkeypatch.setattr(cut_module, "MANY_ROWS", many)

    g = torch.Generator().manual_seed(vocab)
    settings = [(vocab, 1.0, 0.0), (50, 1.0, 0.0), (1, 1.0, 0.0), (vocab, 0.9, 0.0),
                (vocab, 0.5, 0.0), (vocab, 0.999, 0.0), (vocab, 1.0, 0.1), (40, 0.8, 0.05),
                (vocab - 1, 0.95, 0.0), (7, 0.3, 0.5)]
    rows = len(settings)
    probs = torch.softmax(torch.randn(rows, vocab, generator=g) * 4 / temperature, dim=-1)
    probs[3, : vocab // 3] = 0.0  # masked tokens (a grammar's), zero probability
    probs = probs / probs.sum(-1, keepdim=True)
    top_k = torch.tensor([s[0] for s in settings], dtype=torch.int32)
    top_p = torch.tensor([s[1] for s in settings], dtype=torch.float32)
    min_p = torch.tensor([s[2] for s in settings], dtype=torch.float32)
    cut = sampling_cut(probs.to(DEVICE), top_k.to(DEVICE), top_p.to(DEVICE),
                       min_p.to(DEVICE)).cpu()
    got = probs >= cut[:, None]
    want, cum_before, order = _sorted_keep(probs, top_k.long(), top_p, min_p)
    differ = got != want
    # only where two float sums of the same mass may disagree: cum_before within 1e-5 of top_p
    near = torch.zeros_like(differ).scatter_(1, order, (cum_before - top_p[:, None]).abs() < 1e-5)
    assert not (differ & ~near).any(), differ.sum(-1)
    assert got.any(-1).all() and (cut <= probs.max(-1).values).all()


@on_device
def test_cut_with_ties_keeps_all_of_them():
    from engine.kernels.sampling_cut import sampling_cut

    probs = torch.tensor([[0.3, 0.2, 0.2, 0.2, 0.1]])
    cut = sampling_cut(probs.to(DEVICE), torch.tensor([2], dtype=torch.int32).to(DEVICE),
                       torch.tensor([1.0]).to(DEVICE), torch.tensor([0.0]).to(DEVICE)).cpu()
    assert ((probs >= cut[:, None]) == torch.tensor([[True, True, True, True, False]])).all()


@on_device
def test_compile_variants_launches_each_variant(monkeypatch):
    """The warm-up's launches (engine/runtime/warmup.py): top-k and top-p, each alone, min-p alone,
    with few and with many rows' candidates."""
    import engine.kernels.sampling_cut as cut

    seen = []
    real = cut.sampling_cut
    monkeypatch.setattr(cut, "MANY_ROWS", 4)  # the warm-up's many-rows launch, small
    monkeypatch.setattr(cut, "sampling_cut",
                        lambda *a: seen.append((a[0].shape[0] >= 4, *a[4:])) or real(*a))
    cut.compile_variants(300, torch.device(DEVICE))
    assert sorted(seen) == sorted(itertools.product((False, True), repeat=3))


def test_under_the_interpreter():
    pytest.importorskip("triton")
    from triton_on_cpu import run_under_interpreter

    run_under_interpreter("test_sampling_cut.py", select="not sampler_with_the_cut")  # GPU-only


def test_compiles_for_hopper():
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend")
    from triton_on_cpu import compile_for_sm90

    from engine.kernels.sampling_cut import (BLOCK, CHUNK, MANY_ROWS_PIVOTS, PIVOTS, _cut_kernel,
                                            _pass_kernel)

    types = dict(P="*fp32", TopK="*i32", TopP="*fp32", MinP="*fp32", State="*i32", Count="*i32",
                 Mass="*fp32", ChunkMax="*fp32", Cut="*fp32", V="i32")
    for pivots, find_k, find_p in itertools.product((PIVOTS, MANY_ROWS_PIVOTS), (True, False),
                                                    (True, False)):
        fixed = dict(NCHUNK=16, PIVOTS=pivots, FIND_K=find_k, FIND_P=find_p)
        compile_for_sm90(_pass_kernel, types, dict(fixed, CHUNK=CHUNK, BLOCK=BLOCK))
        compile_for_sm90(_cut_kernel, types, fixed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the sampler takes the cut on GPUs")
def test_sampler_with_the_cut_samples_only_kept_tokens():
    """Every sampled token is among its row's top 2, at few and at many rows' candidates."""
    from engine.core.request import Request
    from engine.kernels.sampling_cut import MANY_ROWS
    from engine.executor.sampler import Sampler
    from engine.core.sampling_params import SamplingParams

    for rows in (3, MANY_ROWS + 3):
        logits = torch.randn(rows, 5000, device="cuda") * 2
        reqs = [Request(f"r{i}", [1, 2], SamplingParams(max_tokens=2, temperature=1.0, top_k=2))
                for i in range(rows)]
        tokens = Sampler(torch.device("cuda")).sample_tokens(logits, reqs)
        top2 = logits.topk(2, dim=1).indices
        assert (top2 == tokens[:, None]).any(dim=1).all(), rows
