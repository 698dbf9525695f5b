"""Pure decode steps store the new tokens' K/V in the decode kernel (`STORE_KV` in
engine/kernels/attention/decode.py) instead of a store launch of their own: against the
separate store (`kernels.decode_stores_kv` off), the same outputs and the same pool, bit for
bit. (tests/test_triton_attention.py, test_triton_window.py and test_prefix_groups.py check
the fused store against the torch reference, as every decode there takes it.)

The kernel tests are marked `gpu`; without a GPU `test_fused_store_under_the_interpreter`
runs them under TRITON_INTERPRET=1 (float32 only: the interpreter gets bf16 wrong; bf16
cases on a GPU). The CPU tests also compile the STORE_KV variants for sm_90 and check the
order the fused store needs there: the stores, a barrier, then only coherent loads.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
from triton_on_cpu import run_under_interpreter

import test_prefix_groups as tpg
from engine.attention.kv_pool import KVPool
from engine.quantization.fp8 import FP8
from test_triton_attention import DEVICE, Case, decode_reqs, make_case

kernels = [pytest.mark.gpu,
           pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU (or TRITON_INTERPRET=1)")]

F32, BF16 = torch.float32, torch.bfloat16
# (name, (bsz, max_len), hq, hkv, d, dtype, window, pool kwargs, backend kwargs); pad_to in
# the pool kwargs adds CUDA-graph padding rows (row 0, slot 0)
CASES = [
    ("g4_auto_splits", (6, 700), 8, 2, 64, F32, 0, {}, {}),
    ("g4_splits1", (6, 700), 8, 2, 64, F32, 0, {}, {"force_num_splits": 1}),
    ("g2_splits3_d80", (5, 400), 4, 2, 80, F32, 0, {}, {"force_num_splits": 3}),
    ("g1_splits4", (4, 300), 4, 4, 32, F32, 0, {}, {"force_num_splits": 4}),
    ("window_splits3", (6, 500), 8, 2, 64, F32, 40, {}, {"force_num_splits": 3}),
    ("window_direct", (6, 500), 8, 2, 64, F32, 70, {}, {"force_num_splits": 1}),
    ("fp8_pool_splits3", (6, 500), 8, 2, 64, F32, 0, {"kv_dtype": FP8, "kv_scale": 0.5},
     {"force_num_splits": 3}),
    ("fp8_pool_window", (5, 300), 8, 2, 64, F32, 33, {"kv_dtype": FP8}, {}),
    ("graph_padded", (5, 400), 8, 2, 64, F32, 0, {"pad_to": 8}, {"graph_mode": True}),
]
if DEVICE == "cuda":  # the interpreter's bf16 is wrong
    CASES += [
        ("bf16_g4_d128", (7, 5000), 32, 8, 128, BF16, 0, {}, {}),
        ("bf16_b64_splits32", (64, 3000), 32, 8, 128, BF16, 0, {}, {"force_num_splits": 32}),
        ("bf16_direct", (7, 3000), 16, 4, 128, BF16, 0, {}, {"force_num_splits": 1}),
        ("bf16_window", (7, 3000), 16, 4, 128, BF16, 512, {}, {}),
        ("bf16_fp8_pool", (7, 3000), 32, 8, 128, BF16, 0, {"kv_dtype": FP8}, {}),
        ("bf16_graph_padded", (9, 3000), 32, 8, 128, BF16, 0, {"pad_to": 16},
         {"graph_mode": True}),
    ]


def run(case: Case, fused: bool, window: int, **kw) -> tuple[torch.Tensor, KVPool]:
    """The backend's forward of `case` on a copy of its pool, the new K/V stored by the
    decode kernel (`fused`) or by the store kernel: (output, pool)."""
    from engine.attention import triton_backend

    pool = copy.deepcopy(case.pool)
    be = triton_backend.TritonAttentionBackend(pool, 1.0 / math.sqrt(case.q.shape[-1]),
                                               decode_stores_kv=fused, **kw)
    be.set_sliding_windows({case.layer: window} if window else {})
    out = torch.full(case.q.shape, float("nan"), dtype=case.q.dtype, device=case.q.device)
    be.forward(case.q, case.k, case.v, case.layer, case.batch, out=out)
    return out, pool


def assert_same(case: Case, fused: tuple[torch.Tensor, KVPool],
                separate: tuple[torch.Tensor, KVPool]) -> None:
    """The real requests' outputs and every pool byte (slot 0 too: graph padding's) equal."""
    (out, pool), (ref, ref_pool) = fused, separate
    n = case.real
    assert not out[:n].isnan().any()
    assert torch.equal(out[:n], ref[:n])
    for got, want in zip(pool.k + pool.v, ref_pool.k + ref_pool.v):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("i", range(len(CASES)), ids=[c[0] for c in CASES])
@kernels[0]
@kernels[1]
def test_fused_store_equals_separate_store(i):
    name, (bsz, max_len), hq, hkv, d, dtype, window, pool_kw, kw = CASES[i]
    case = make_case(decode_reqs(bsz, max_len, 900 + i), hq, hkv, d, dtype, DEVICE,
                     seed=900 + i, **pool_kw)
    assert case.batch.is_decode
    assert_same(case, run(case, True, window, **kw), run(case, False, window, **kw))


@kernels[0]
@kernels[1]
def test_fused_store_with_prefix_groups():
    """Radix-grouped decode (HAS_PREFIX): the new token is always in the suffix the decode
    kernel attends, so it is stored there too."""
    name, groups, singles, hq, hkv, d, dtype, splits, kw = tpg.GROUPED[0]
    case, spec = tpg.make_grouped_case(groups, singles, hq, hkv, d, dtype, seed=950)
    results = []
    for fused in (True, False):
        run_case = Case(copy.deepcopy(case.pool), case.batch, case.q, case.k, case.v,
                        case.layer, case.real)
        results.append((tpg.run_grouped(run_case, spec, splits, decode_stores_kv=fused, **kw)[0],
                        run_case.pool))
    assert_same(case, *results)


@pytest.mark.skipif(DEVICE != "cuda", reason="inspects the binaries compiled on a GPU")
@kernels[0]
def test_launched_binaries_read_the_pool_coherently():
    """The binaries the launches compiled (with their real alignment and divisibility
    specializations) read the pool with coherent loads in the generic proxy, which the
    barrier after the store orders: a read-only ld.global.nc could miss the program's own
    store, and a bulk (TMA) copy would need a proxy fence."""
    from engine.kernels.attention.decode import decode_partial_kernel

    case = make_case(decode_reqs(7, 3000, 3), 32, 8, 128, BF16, DEVICE, seed=3)
    run(case, True, 0)
    binaries = [kernel for caches in decode_partial_kernel.device_caches.values()
                for kernel in caches[0].values()]
    assert binaries
    for kernel in binaries:
        ptx = kernel.asm["ptx"]
        assert "ld.global.nc" not in ptx and "cp.async.bulk" not in ptx


# ------------------------------------------------------------------ without a GPU
def test_fused_store_under_the_interpreter():
    pytest.importorskip("triton")
    run_under_interpreter("test_decode_store_kv.py", allow_skipped=True)


@pytest.mark.parametrize("variant", [dict(DIRECT=True), dict(DIRECT=False),
                                     dict(DIRECT=False, WINDOW=512),
                                     dict(DIRECT=True, HAS_PREFIX=True),
                                     dict(DIRECT=False, KV_FP8=True, KV_SCALE=0.5)],
                         ids=["direct", "splits", "window", "prefix", "fp8_pool"])
def test_store_kv_variants_compile_for_hopper(variant):
    """The STORE_KV variants compile for sm_90: the new K/V are stored, then a barrier, then
    the loads, none of them non-coherent (read-only cache)."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend")
    from triton_on_cpu import compile_for_sm90

    from engine.kernels.attention.decode import decode_partial_kernel

    pool = "*fp8e4nv" if variant.get("KV_FP8") else "*bf16"
    types = dict(Q="*bf16", K="*bf16", V="*bf16", Out="*bf16", KC=pool, VC=pool,
                 MidO="*fp32", MidLse="*fp32", PfxO="*fp32", PfxLse="*fp32", SeqLens="*i32",
                 ExtendLens="*i32", QoIndptr="*i32", sm_scale_log2="fp32")
    ptx = compile_for_sm90(decode_partial_kernel, types,
                           dict(variant, HEAD_DIM=128, BLOCK_D=128, F32_DOT=False, GROUP=4,
                                BLOCK_N=64, BLOCK_H=16, STORE_KV=True))
    body = ptx[ptx.index(".entry"):]
    first = body.index("st.global")
    stores = body[first:body.index("bar.sync", first)]
    assert stores.count("st.global") >= 2  # K's and V's
    assert "ld.global" not in stores[stores.rindex("st.global"):]  # the barrier comes next
    assert "ld.global.nc" not in body
