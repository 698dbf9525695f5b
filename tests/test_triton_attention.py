"""TritonAttentionBackend vs the torch reference (GPU only).

Every test is marked `gpu` and skipped without CUDA. For kernel development without a GPU,
`TRITON_INTERPRET=1` runs the same tests on the CPU through Triton's interpreter (shapes
shrunk; slow). The helpers here are shared with scripts/check_attention.py.
"""
from __future__ import annotations

import copy
import math
import os
import random
from dataclasses import dataclass

import pytest
import torch

from engine.attention.base import ForwardBatch, leading_decode_rows
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.kv_pool import KVPool
from engine.quantization.fp8 import FP8

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def test_device() -> str | None:
    if torch.cuda.is_available():
        return "cuda"
    if INTERPRET:
        return "cpu"
    return None


test_device.__test__ = False  # a helper, not a test

DEVICE = test_device()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU (or TRITON_INTERPRET=1)"),
]

TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-4}
DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Case:
    pool: KVPool
    batch: ForwardBatch
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layer: int
    real: int  # leading requests that are real (the rest are graph padding)


def make_case(reqs: list[tuple[int, int]], hq: int, hkv: int, d: int, dtype: torch.dtype,
              device: str, *, num_layers: int = 2, pad_to: int = 0, num_slots: int | None = None,
              max_ctx: int | None = None, fused_qkv: bool = True, seed: int = 0,
              fill_pool: bool = True, kv_dtype: torch.dtype | None = None,
              kv_scale: float = 1.0, split_mixed: bool = True,
              decoders_on_device: bool = False) -> Case:
    """A random step. reqs = [(prefix_len, extend_len)]; all extend_len == 1 makes a decode.
    In a mixed step the leading one-token requests go to the decode kernel (`decode_rows`)
    unless `split_mixed` is off (every request through the extend kernel); with
    `decoders_on_device` (as an extend graph) the kernels find every one-token request on
    the device instead, wherever it is. A (0, 0) request is an extend graph's padding.
    kv_dtype=FP8 makes a float8 pool with scale kv_scale (q/k/v stay in `dtype`).

    Slots are a random permutation (never contiguous), rows are random, unused
    req_to_token entries hold random valid slots (so out-of-range reads show up), the pool
    holds random data. pad_to > len(reqs) appends CUDA-graph padding entries (seq_len 1,
    row 0, slot 0, identical k/v so the shared slot 0 is deterministic).
    """
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    n_real = len(reqs)
    n_pad = max(0, pad_to - n_real)
    seq_lens = [p + e for p, e in reqs] + [1] * n_pad
    ext_lens = [e for _, e in reqs] + [1] * n_pad
    total = sum(p + e for p, e in reqs)
    if num_slots is None:
        num_slots = total + 64
    if max_ctx is None:
        max_ctx = max(seq_lens) + 5
    pool = KVPool(num_slots, num_layers, hkv, d, kv_dtype or dtype, device, scale=kv_scale)
    if fill_pool:
        for t in pool.k + pool.v:
            data = torch.randn(t.shape, generator=g).to(dtype)
            data[0] = float("nan")  # the padding slot may hold garbage: it must never leak in
            t.copy_(data)  # (a copy casts to float8 on any device; fill_ may not)
    n_rows = n_real + 3
    r2t = torch.randint(0, num_slots + 1, (n_rows, max_ctx), generator=g, dtype=torch.int32)
    r2t[0, 0] = 0
    perm = (torch.randperm(num_slots, generator=g) + 1).tolist()
    rows = rng.sample(range(1, n_rows), n_real) + [0] * n_pad
    out_slots, pos = [], []
    cursor = 0
    for i, (p, e) in enumerate(reqs):
        slots = perm[cursor:cursor + p + e]
        cursor += p + e
        r2t[rows[i], :p + e] = torch.tensor(slots, dtype=torch.int32)
        out_slots += slots[p:]
        pos += list(range(p, p + e))
    out_slots += [0] * n_pad
    pos += [0] * n_pad
    T = len(out_slots)
    qo = [0]
    for e in ext_lens:
        qo.append(qo[-1] + e)
    if fused_qkv:  # q/k/v as views of one fused projection output (strided rows)
        qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=g).to(dtype)
        q = qkv[:, :hq * d].view(T, hq, d)
        k = qkv[:, hq * d:(hq + hkv) * d].view(T, hkv, d)
        v = qkv[:, (hq + hkv) * d:].view(T, hkv, d)
    else:
        q = torch.randn(T, hq, d, generator=g).to(dtype)
        k = torch.randn(T, hkv, d, generator=g).to(dtype)
        v = torch.randn(T, hkv, d, generator=g).to(dtype)
    if n_pad:
        k[T - n_pad:] = k[T - n_pad]
        v[T - n_pad:] = v[T - n_pad]
    dev = torch.device(device)
    batch = ForwardBatch(
        input_ids=torch.zeros(T, dtype=torch.int64, device=dev),
        positions=torch.tensor(pos, dtype=torch.int64, device=dev),
        out_slots=torch.tensor(out_slots, dtype=torch.int64, device=dev),
        req_rows=torch.tensor(rows, dtype=torch.int64, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        extend_lens=torch.tensor(ext_lens, dtype=torch.int32, device=dev),
        qo_indptr=torch.tensor(qo, dtype=torch.int32, device=dev),
        logits_indices=torch.tensor([x - 1 for x in qo[1:]], dtype=torch.int64, device=dev),
        req_to_token=r2t.to(dev),
        is_decode=all(e == 1 for e in ext_lens),
        seq_lens_cpu=seq_lens,
        extend_lens_cpu=ext_lens,
    )
    if decoders_on_device:
        batch.decoders_on_device = True
    elif not batch.is_decode and split_mixed:  # as ModelRunner: leading decoders by decode kernel
        batch.decode_rows = leading_decode_rows(ext_lens)
    return Case(pool, batch, q.to(dev), k.to(dev), v.to(dev), num_layers - 1, n_real)


def reference(case: Case) -> tuple[torch.Tensor, KVPool]:
    """fp32 torch reference on an fp32 copy of the pool (pool as it was before the step).
    An fp8 pool is copied as it is: the torch backend's fp8 path stores the new K/V
    (KVPool.encode) and reads every K/V back dequantized, here to fp32."""
    p = case.pool
    if p.fp8:
        ref_pool = copy.copy(p)  # dtype and scale as the original's
        ref_pool.k, ref_pool.v = [t.clone() for t in p.k], [t.clone() for t in p.v]
    else:
        ref_pool = KVPool.over([t.float().clone() for t in p.k], [t.float().clone() for t in p.v])
    be = TorchAttentionBackend(ref_pool, 1.0 / math.sqrt(case.q.shape[-1]))
    out = be.forward(case.q.float(), case.k.float(), case.v.float(), case.layer, case.batch)
    return out, ref_pool


def run_backend(case: Case, **kw) -> torch.Tensor:
    from engine.attention.triton_backend import TritonAttentionBackend

    be = TritonAttentionBackend(case.pool, 1.0 / math.sqrt(case.q.shape[-1]), **kw)
    be.prepare(case.batch)
    out = torch.full(case.q.shape, float("nan"), dtype=case.q.dtype, device=case.q.device)
    be.forward(case.q, case.k, case.v, case.layer, case.batch, out=out)
    return out


def compare(case: Case, out: torch.Tensor, ref: torch.Tensor, ref_pool: KVPool) -> dict:
    """Relative error over the real requests' rows, NaN (unwritten) check, pool check."""
    n_tok = int(case.batch.qo_indptr[case.real].item())
    o, r = out[:n_tok].float(), ref[:n_tok].float()
    nan = bool(torch.isnan(o).any().item())
    rel = float((o - r).norm() / r.norm().clamp_min(1e-30))

    def same(a, b):
        if case.pool.fp8:  # the stores must give torch's float8 bits exactly
            return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return torch.allclose(a.float(), b, rtol=0, atol=0, equal_nan=True)

    pool_ok = all(same(a, b) for a, b in zip(case.pool.k + case.pool.v, ref_pool.k + ref_pool.v))
    tol = TOL[case.q.dtype]
    return dict(rel=rel, nan=nan, pool_ok=pool_ok, tol=tol,
                ok=(not nan) and rel < tol and pool_ok)


def check(reqs, hq, hkv, d, dtype, *, seed=0, pad_to=0, fused_qkv=True, kv_dtype=None,
          kv_scale=1.0, split_mixed=True, decoders_on_device=False, **kw) -> dict:
    case = make_case(reqs, hq, hkv, d, dtype, DEVICE, seed=seed, pad_to=pad_to,
                     fused_qkv=fused_qkv, kv_dtype=kv_dtype, kv_scale=kv_scale,
                     split_mixed=split_mixed, decoders_on_device=decoders_on_device)
    ref, ref_pool = reference(case)
    out = run_backend(case, **kw)
    return compare(case, out, ref, ref_pool)


# ------------------------------------------------------------------ case lists
def _shrink(n: int) -> int:
    """Under the CPU interpreter keep sizes small."""
    return max(1, min(n, 150)) if DEVICE == "cpu" else n


def decode_reqs(bsz: int, max_len: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    if DEVICE == "cpu":
        bsz = min(bsz, 6)
    lens = [rng.randint(1, _shrink(max_len)) for _ in range(bsz)]
    if bsz > 1:
        lens[0] = _shrink(max_len)  # one long one
        lens[1] = 1
    return [(n - 1, 1) for n in lens]


# (name, bsz, max_len, hq, hkv, d, dtype, kwargs)
DECODE_CASES = [
    ("b1_len1", 1, 1, 8, 2, 64, "fp32", {}),
    ("b1_len4999_g4", 1, 4999, 32, 8, 128, "bf16", {}),
    ("b7_g8_d128", 7, 5000, 16, 2, 128, "bf16", {}),
    ("b7_g1_d64_fp32", 7, 5000, 4, 4, 64, "fp32", {}),
    ("b64_g4_d128", 64, 5000, 32, 8, 128, "bf16", {}),
    ("b64_g8_d64_fp16", 64, 3000, 16, 2, 64, "fp16", {}),
    ("b64_g8_d128_fp32", 64, 2000, 8, 1, 128, "fp32", {}),
    ("b7_g4_d16_fp32", 7, 700, 8, 2, 16, "fp32", {}),
    ("b7_g2_d80_bf16", 7, 700, 4, 2, 80, "bf16", {}),
    ("b7_g4_d256_bf16", 7, 1500, 8, 2, 256, "bf16", {}),
    ("b7_splits1", 7, 3000, 16, 4, 128, "bf16", {"force_num_splits": 1}),
    ("b7_splits3", 7, 3000, 16, 4, 128, "bf16", {"force_num_splits": 3}),
    ("b7_splits32", 7, 3000, 16, 4, 128, "bf16", {"force_num_splits": 32}),
    ("b7_graphmode", 7, 3000, 16, 4, 64, "bf16", {"graph_mode": True}),
]

# (name, [(prefix, extend)], hq, hkv, d, dtype)
EXTEND_CASES = [
    ("one_prefill", [(0, 37)], 32, 8, 128, "bf16"),
    ("ragged_fp32", [(0, 1), (0, 300), (0, 5)], 4, 4, 64, "fp32"),
    ("prefix_mix", [(100, 50), (0, 129), (2000, 1), (17, 64)], 32, 4, 128, "bf16"),
    ("mixed_decode", [(500, 1)] * 10 + [(0, 700), (1000, 200)], 16, 4, 64, "fp16"),
    ("long_prefix", [(3000, 128)], 32, 8, 128, "bf16"),
    ("d16_fp32", [(40, 33), (0, 17)], 8, 2, 16, "fp32"),
    ("d80_bf16", [(70, 90), (3, 1)], 4, 2, 80, "bf16"),
    ("d256_bf16", [(300, 70), (0, 65)], 8, 2, 256, "bf16"),
    ("chunk_fp32_g8", [(256, 256), (1, 255)], 16, 2, 128, "fp32"),
]


def extend_reqs(reqs):
    if DEVICE != "cpu":
        return reqs
    return [(min(p, 120), min(e, 70)) for p, e in reqs[:5]]


# FP8 KV pool (kv_cache_dtype="fp8_e4m3"), against the torch backend's fp8 path on a copy of
# the same pool. Both read the same float8 values (the kernels quantize new K/V exactly as
# KVPool.encode: the pool bits must match), so only arithmetic differs and the tolerance is
# the model dtype's, as for bf16/fp16/fp32 pools. Scales != 1 take the divide/multiply path.
# (name, bsz, max_len, hq, hkv, d, dtype, kv_scale, kwargs)
FP8_DECODE_CASES = [
    ("b7_g4_d128", 7, 3000, 16, 4, 128, "bf16", 1.0, {}),
    ("b64_g4_d128", 64, 3000, 32, 8, 128, "bf16", 1.0, {}),
    ("b7_g8_d64_fp16_scale", 7, 2000, 16, 2, 64, "fp16", 0.25, {}),
    ("b7_g4_d64_fp32", 7, 1000, 8, 2, 64, "fp32", 1.0, {}),
    ("b7_g2_d80", 7, 700, 4, 2, 80, "bf16", 1.0, {}),
    ("b7_splits3_scale", 7, 3000, 16, 4, 128, "bf16", 2.0, {"force_num_splits": 3}),
    ("b7_graphmode", 7, 3000, 16, 4, 64, "bf16", 1.0, {"graph_mode": True}),
]

# (name, [(prefix, extend)], hq, hkv, d, dtype, kv_scale)
FP8_EXTEND_CASES = [
    ("prefix_mix", [(100, 50), (0, 129), (2000, 1), (17, 64)], 32, 4, 128, "bf16", 1.0),
    ("long_prefix", [(3000, 128)], 32, 8, 128, "bf16", 1.0),
    ("ragged_fp16_scale", [(0, 1), (40, 300), (300, 5)], 8, 2, 64, "fp16", 0.5),
    ("d80_fp32", [(70, 90), (3, 1)], 4, 2, 80, "fp32", 1.0),
]


def check_fp8_decode(i: int) -> dict:
    name, bsz, max_len, hq, hkv, d, dt, scale, kw = FP8_DECODE_CASES[i]
    return check(decode_reqs(bsz, max_len, 200 + i), hq, hkv, d, DT[dt], seed=200 + i,
                 kv_dtype=FP8, kv_scale=scale, **kw)


def check_fp8_extend(i: int) -> dict:
    name, reqs, hq, hkv, d, dt, scale = FP8_EXTEND_CASES[i]
    return check(extend_reqs(reqs), hq, hkv, d, DT[dt], seed=300 + i, kv_dtype=FP8,
                 kv_scale=scale)


def all_checks() -> list[tuple[str, dict]]:
    """Every case above, plus graph-padding and CUDA-graph replay; for the check script."""
    rows = []
    for i, (name, bsz, max_len, hq, hkv, d, dt, kw) in enumerate(DECODE_CASES):
        rows.append(("decode/" + name, check(decode_reqs(bsz, max_len, i), hq, hkv, d, DT[dt],
                                             seed=i, **kw)))
    for i, (name, reqs, hq, hkv, d, dt) in enumerate(EXTEND_CASES):
        rows.append(("extend/" + name, check(extend_reqs(reqs), hq, hkv, d, DT[dt], seed=100 + i)))
    for i, case in enumerate(FP8_DECODE_CASES):
        rows.append(("fp8/decode/" + case[0], check_fp8_decode(i)))
    for i, case in enumerate(FP8_EXTEND_CASES):
        rows.append(("fp8/extend/" + case[0], check_fp8_extend(i)))
    rows.append(("decode/padded", check_padded()))
    rows.append(("fp8/decode/padded", check_padded(FP8)))
    if DEVICE == "cuda":
        rows.append(("decode/cuda_graph", check_cuda_graph()))
        rows.append(("fp8/decode/cuda_graph", check_cuda_graph(FP8)))
    return rows


def check_padded(kv_dtype=None) -> dict:
    return check(decode_reqs(5, 2000, 7), 16, 4, 128, torch.bfloat16, seed=7, pad_to=12,
                 kv_dtype=kv_dtype)


def check_cuda_graph(kv_dtype=None) -> dict:
    """Capture a padded decode once, then replay it on another step's data (other seq lens,
    rows, slots, pool contents) copied into the captured tensors."""
    hq, hkv, d, dt, pad = 32, 8, 128, torch.bfloat16, 16
    kw = dict(num_slots=40000, max_ctx=4200, pad_to=pad, kv_dtype=kv_dtype)
    a = make_case(decode_reqs(9, 300, 1), hq, hkv, d, dt, DEVICE, seed=1, **kw)
    b = make_case(decode_reqs(9, 4000, 2), hq, hkv, d, dt, DEVICE, seed=2, **kw)
    return replay_on_other_step(a, b, ("out_slots", "req_rows", "seq_lens", "req_to_token",
                                       "positions"))


def replay_on_other_step(a: Case, b: Case, fields: tuple[str, ...]) -> dict:
    """Capture the Triton backend's forward of step `a` in a CUDA graph (graph mode), copy
    step `b`'s pool, q/k/v and batch `fields` into a's tensors, replay, and compare the
    output with the reference attention of `b`."""
    from engine.attention.triton_backend import TritonAttentionBackend

    be = TritonAttentionBackend(a.pool, 1.0 / math.sqrt(a.q.shape[-1]), graph_mode=True)
    out = torch.full(a.q.shape, float("nan"), dtype=a.q.dtype, device=DEVICE)
    be.prepare(a.batch)
    be.forward(a.q, a.k, a.v, a.layer, a.batch, out=out)  # compile + buffers, outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        be.forward(a.q, a.k, a.v, a.layer, a.batch, out=out)
    ref, ref_pool = reference(b)
    for x, y in zip(a.pool.k + a.pool.v, b.pool.k + b.pool.v):
        x.copy_(y)
    for name in fields:
        getattr(a.batch, name).copy_(getattr(b.batch, name))
    a.q.copy_(b.q), a.k.copy_(b.k), a.v.copy_(b.v)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return compare(Case(a.pool, b.batch, b.q, b.k, b.v, b.layer, b.real), out, ref, ref_pool)


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_decode(case):
    name, bsz, max_len, hq, hkv, d, dt, kw = case
    i = DECODE_CASES.index(case)
    r = check(decode_reqs(bsz, max_len, i), hq, hkv, d, DT[dt], seed=i, **kw)
    assert r["ok"], r


@pytest.mark.parametrize("case", EXTEND_CASES, ids=[c[0] for c in EXTEND_CASES])
def test_extend(case):
    name, reqs, hq, hkv, d, dt = case
    i = EXTEND_CASES.index(case)
    r = check(extend_reqs(reqs), hq, hkv, d, DT[dt], seed=100 + i)
    assert r["ok"], r


# Mixed steps: decoders first (as the scheduler orders them), then prefill chunks; the
# decoders take the decode kernel (several split counts: short and long contexts) and the
# extend kernel the rest, or with split_mixed off the extend kernel takes all.
MIXED_CASES = [
    ("decoders_then_prefill", [(700, 1), (30, 1), (2500, 1), (0, 1)] * 2 + [(0, 300), (90, 70)],
     32, 8, 128, "bf16"),
    ("one_decoder_long_ctx", [(4000, 1), (10, 129)], 16, 4, 64, "fp16"),
    ("fp32_g1", [(64, 1), (200, 1), (5, 33), (0, 1)], 4, 4, 64, "fp32"),
]


def mixed_reqs(reqs):
    """Under the CPU interpreter: every request kept (the mix is the point), sizes shrunk."""
    if DEVICE != "cpu":
        return reqs
    return [(min(p, 150), min(e, 70)) for p, e in reqs]


def mixed_heads(hq: int, hkv: int) -> tuple[int, int]:
    """Under the CPU interpreter: at most two KV heads (still more than one, so a wrong head
    offset shows), each with its query group whole (the group sets the decode kernel's
    BLOCK_H and the extend kernel's GQA rows); the interpreter's time grows with the heads."""
    if DEVICE != "cpu" or hkv <= 2:
        return hq, hkv
    return 2 * (hq // hkv), 2


@pytest.mark.parametrize("split", [True, False], ids=["decode_kernel", "extend_only"])
@pytest.mark.parametrize("case", MIXED_CASES, ids=[c[0] for c in MIXED_CASES])
def test_mixed_step(case, split):
    name, reqs, hq, hkv, d, dt = case
    r = check(mixed_reqs(reqs), *mixed_heads(hq, hkv), d, DT[dt], seed=300 + MIXED_CASES.index(case),
              split_mixed=split)
    assert r["ok"], r


def test_mixed_steps_in_the_engine_match_torch(tiny_model_factory):
    """The engine with Triton attention against the torch backend, greedy, on steps where
    new prompts join requests already decoding (eager mixed steps: 3, 4 and 5 leading
    decoders through the decode kernel): the same tokens, logprobs within 1e-4."""
    from engine_steps import run_with_arrivals

    from engine import LLM, SamplingParams

    path = tiny_model_factory("llama")
    rng = random.Random(12)
    prompts = [[rng.randint(3, 700) for _ in range(rng.randint(20, 60))] for _ in range(6)]
    arrivals = [0, 0, 0, 3, 5, 6]  # the engine step each prompt arrives at
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True)
    runs, mixed = {}, []
    for backend in ("triton", "torch"):
        graphs = dict(cuda_graph_max_extend_tokens=0) if backend == "triton" else \
            dict(enable_cuda_graph=False)  # (the torch backend is not graph-capturable)
        engine = LLM(model=path, dtype="float32", device=DEVICE, max_total_tokens=4096,
                     attention_backend=backend, chunked_prefill_size=512, **graphs).engine
        if backend == "triton":
            forward = engine.runner.attn_backend.forward

            def spy(q, k, v, layer_id, batch, *args, **kw):
                if layer_id == 0 and not batch.is_decode:
                    mixed.append(batch.decode_rows)
                return forward(q, k, v, layer_id, batch, *args, **kw)

            engine.runner.attn_backend.forward = spy
        runs[backend] = run_with_arrivals(engine, prompts, arrivals, params)
    assert sorted(mixed)[-3:] == [3, 4, 5], mixed
    for (ids, lps), (ref_ids, ref_lps) in zip(runs["triton"], runs["torch"]):
        assert ids == ref_ids
        assert max(abs(x - y) for x, y in zip(lps, ref_lps)) < 1e-4


# Extend graphs: decoders anywhere in the step, found on the device; (0, 0) = graph padding.
DEVICE_MIXED_CASES = [
    ("interleaved", [(0, 40), (700, 1), (30, 1), (90, 70), (2500, 1), (0, 0), (0, 0)],
     32, 8, 128, "bf16"),
    ("decoders_only_padded", [(300, 1), (1000, 1), (0, 0)], 16, 4, 64, "fp16"),
    ("fp32_g1", [(64, 1), (5, 33), (200, 1)], 4, 4, 64, "fp32"),
]


@pytest.mark.parametrize("case", DEVICE_MIXED_CASES, ids=[c[0] for c in DEVICE_MIXED_CASES])
def test_mixed_step_decoders_found_on_device(case):
    name, reqs, hq, hkv, d, dt = case
    r = check(mixed_reqs(reqs), *mixed_heads(hq, hkv), d, DT[dt],
              seed=320 + DEVICE_MIXED_CASES.index(case),
              decoders_on_device=True)
    assert r["ok"], r


def test_mixed_step_decoders_found_on_device_fp8_pool():
    reqs = mixed_reqs([(17, 50), (900, 1), (0, 0)])
    r = check(reqs, *mixed_heads(16, 4), 128, torch.bfloat16, seed=330, kv_dtype=FP8, kv_scale=0.5,
              decoders_on_device=True)
    assert r["ok"], r


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_mixed_step_graph_replay_finds_other_decoders():
    """Capture a mixed step as an extend graph does, then replay it on another step of the
    same shape whose decoders sit at other positions."""
    hq, hkv, d, dt = 32, 8, 128, torch.bfloat16
    kw = dict(num_slots=8000, max_ctx=3000, decoders_on_device=True)
    a = make_case([(0, 40), (700, 1), (30, 1), (0, 0)], hq, hkv, d, dt, DEVICE, seed=11, **kw)
    b = make_case([(300, 1), (5, 40), (1200, 1), (0, 0)], hq, hkv, d, dt, DEVICE, seed=12, **kw)
    r = replay_on_other_step(a, b, ("out_slots", "req_rows", "seq_lens", "extend_lens",
                                    "qo_indptr", "req_to_token", "positions"))
    assert r["ok"], r


def test_mixed_step_fp8_pool():
    reqs = mixed_reqs([(900, 1), (17, 1), (0, 200), (40, 1)])
    r = check(reqs, *mixed_heads(16, 4), 128, torch.bfloat16, seed=310, kv_dtype=FP8, kv_scale=0.5)
    assert r["ok"], r


def test_extend_contiguous_inputs():
    r = check(extend_reqs([(33, 40), (0, 9)]), 8, 2, 64, torch.bfloat16, seed=5, fused_qkv=False)
    assert r["ok"], r


def test_decode_graph_padding():
    r = check_padded()
    assert r["ok"], r


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_decode_cuda_graph_replay():
    r = check_cuda_graph()
    assert r["ok"], r


# ------------------------------------------------------------------ FP8 KV pool
@pytest.mark.parametrize("i", range(len(FP8_DECODE_CASES)), ids=[c[0] for c in FP8_DECODE_CASES])
def test_fp8_decode(i):
    r = check_fp8_decode(i)
    assert r["ok"], r


@pytest.mark.parametrize("i", range(len(FP8_EXTEND_CASES)), ids=[c[0] for c in FP8_EXTEND_CASES])
def test_fp8_extend(i):
    r = check_fp8_extend(i)
    assert r["ok"], r


def test_fp8_decode_graph_padding():
    r = check_padded(FP8)
    assert r["ok"], r


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_fp8_decode_cuda_graph_replay():
    r = check_cuda_graph(FP8)
    assert r["ok"], r


@pytest.mark.parametrize("scale", [1.0, 0.5, 3.0])
def test_fp8_store_is_kv_pool_encode(scale):
    """The store kernel writes KVPool.encode's float8 bits exactly: saturation at +-448
    (after dividing by the scale), ties to even, subnormals, signed zeros; and rounds its
    inputs in place to what the pool holds (the extend kernel reads them from there)."""
    from engine.attention.triton_backend import TritonAttentionBackend

    g = torch.Generator().manual_seed(3)
    t, hkv, d = 64, 2, 64
    pool = KVPool(t + 4, 1, hkv, d, FP8, DEVICE, scale=scale)
    shape = (2, t, hkv, d)
    x = torch.randn(shape, generator=g) * torch.exp(2 * torch.randn(shape, generator=g))
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float().unique()
    grid = grid[~grid.isnan()]
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties between neighbouring float8 values
    special = torch.cat([grid, mids, torch.tensor([500.0, -1e4, 1e-9, -1e-9, 0.0, -0.0])])
    x.view(-1)[:special.numel()] = special
    k, v = (x * scale).to(torch.bfloat16).to(DEVICE)  # bf16 inputs, as a bf16 model gives
    slots = torch.arange(1, t + 1, device=DEVICE)
    be = TritonAttentionBackend(pool, 1.0)
    k_in, v_in = k.clone(), v.clone()
    be.store_kv(k, v, pool.k[0], pool.v[0], slots)
    for got, new, rounded in ((pool.k[0], k_in, k), (pool.v[0], v_in, v)):
        want = pool.encode(new)
        assert torch.equal(got[1:t + 1].view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(rounded, pool.decode(want, torch.bfloat16))


def test_fp8_pool_error_is_fp8_rounding():
    """The fp8 path against full precision (the bf16 pool's values, unrounded): a few percent,
    the size of one e4m3 rounding of K and V, and not zero (the pool really is float8)."""
    reqs = extend_reqs([(300, 40), (0, 77)])
    dense = make_case(reqs, 8, 2, 64, torch.bfloat16, DEVICE, seed=9)
    fp8 = make_case(reqs, 8, 2, 64, torch.bfloat16, DEVICE, seed=9, kv_dtype=FP8)
    ref, _ = reference(dense)
    err = float((run_backend(fp8).float() - ref).norm() / ref.norm())
    print(f"fp8 KV pool vs full precision: relative error {err:.4f}")
    assert 0.005 < err < 0.06


def test_no_triton_import_from_engine():
    """Importing the engine's attention base, torch backend and pool never loads the Triton
    backend modules (which import triton at their top). Whether triton itself ends up in
    sys.modules is not checked: third-party imports (torch, transformers) may load it."""
    import subprocess
    import sys

    code = ("import sys; import engine.attention.base, engine.attention.torch_backend, "
            "engine.attention.kv_pool; bad = [m for m in sys.modules "
            "if m.startswith('engine.attention.triton')]; assert not bad, bad")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
