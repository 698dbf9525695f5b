"""FP8 KV pool (kv_cache_dtype="fp8_e4m3") on the Triton attention backend.

Decode, extend and store kernels: tests/test_triton_attention.py (`fp8` cases). Here:
- every fp8 kernel variant compiled for sm_90 on any machine (CPU test; Triton's NVIDIA
  backend compiles ahead of time): the interpreter does not run Triton's compiler;
- the radix-grouped decode kernels (shared-prefix kernel + suffix merge) on an fp8 pool,
  through tests/test_prefix_groups.py's grouped checks: against the torch backend's fp8 path
  and the plain decode kernel on the same pool. Marked `gpu`; on a CPU they run under
  TRITON_INTERPRET=1 (small shapes), like the other kernel tests;
- the whole engine on a GPU (CUDA only): greedy tokens of the Triton fp8 path with CUDA
  graphs equal the torch backend's fp8 path (fp32 model: only summation order differs);
  logprobs of a bf16 model stay close to the bf16 pool's.

Tolerance of the last check: the tiny random demo model amplifies KV rounding (see
tests/test_fp8.py). With the torch backend on a CPU (bf16 model, 8 prompts x 16 greedy
tokens, teacher-forced against the bf16 pool) the fp8 pool moved the chosen
tokens' logprobs by 0.26 on average (max 2.0; mean |logprob| 1.8); decode against prefill
scoring on one bf16 pool differs by 0.001. We allow a mean of 0.5.
"""
from __future__ import annotations

import functools
import random
import re

import pytest
import torch
import triton
import triton.language as tl

import test_prefix_groups as tpg
from engine.kernels.attention.common import kv_decode
from engine.quantization.fp8 import FP8
from test_triton_attention import DEVICE, make_case

kernels = [pytest.mark.gpu,
           pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU (or TRITON_INTERPRET=1)")]
cuda = [pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


# ------------------------------------------------------------------ grouped decode kernels
def check_grouped_fp8(i: int, kv_scale: float, monkeypatch) -> dict:
    """tests/test_prefix_groups.py's grouped case i with its pool made float8."""
    monkeypatch.setattr(tpg, "make_case",
                        functools.partial(make_case, kv_dtype=FP8, kv_scale=kv_scale))
    name, groups, singles, hq, hkv, d, dt, splits, kw = tpg.GROUPED[i]
    return tpg.check_grouped(groups, singles, hq, hkv, d, dt, seed=700 + i, splits=splits, **kw)


@pytest.mark.parametrize("i", range(len(tpg.GROUPED)), ids=[c[0] for c in tpg.GROUPED])
@kernels[0]
@kernels[1]
def test_fp8_grouped_decode(i, monkeypatch):
    r = check_grouped_fp8(i, 1.0 if i % 2 == 0 else 0.5, monkeypatch)
    assert r["ok"], r


@kernels[0]
@kernels[1]
def test_fp8_grouped_decode_padded(monkeypatch):
    monkeypatch.setattr(tpg, "make_case", functools.partial(make_case, kv_dtype=FP8))
    r = tpg.check_grouped_padded()
    assert r["ok"], r


# ------------------------------------------------------------------ the load-side cast
@triton.jit
def _kv_decode_kernel(X, Y, KV_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(Y + i, kv_decode(tl.load(X + i), True, KV_SCALE))


@pytest.mark.parametrize("kv_scale", [1.0, 0.5])
@kernels[0]
@kernels[1]
def test_kv_decode_is_exact_for_every_code(kv_scale):
    """Every float8 code but NaN, through the kernels' load-side cast (to float16, the dots'
    operand type over an fp8 pool), equals torch's conversion bit for bit."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].repeat(2)[:256]  # no NaN; a power of two long
    x = codes.view(FP8).to(DEVICE)
    y = torch.empty(256, dtype=torch.float16, device=DEVICE)
    _kv_decode_kernel[(1,)](x, y, KV_SCALE=kv_scale, BLOCK=256)
    want = (x.float() * kv_scale).half() if kv_scale != 1.0 else x.half()
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))


# ------------------------------------------------------------------ compiles for Hopper
def _compile_for_sm90(fn, dtypes: dict[str, str], constexprs: dict, num_warps: int = 4) -> str:
    """`compile_for_sm90` with pointer dtypes named without their "*"."""
    from triton_on_cpu import compile_for_sm90

    return compile_for_sm90(fn, {"sm_scale_log2": "fp32", **{k: "*" + v for k, v in dtypes.items()}},
                            constexprs, num_warps=num_warps)


@pytest.mark.parametrize("kv_scale", [1.0, 0.5])
def test_fp8_kernels_compile_for_hopper(kv_scale):
    """The interpreter runs the kernels' Python, not Triton's compiler (which is stricter,
    e.g. about types across branches): compile every fp8 variant for sm_90 here, and check
    the store really uses the hardware's saturating round-to-nearest cast."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend")
    from engine.kernels.attention.common import store_kv_kernel
    from engine.kernels.attention.decode import decode_partial_kernel, prefix_attn_kernel
    from engine.kernels.attention.extend import extend_kernel

    io = dict(Q="bf16", K="bf16", V="bf16", Out="bf16", KC="fp8e4nv", VC="fp8e4nv",
              MidO="fp32", MidLse="fp32", PfxO="fp32", PfxLse="fp32")
    kv = dict(HEAD_DIM=128, BLOCK_D=128, KV_FP8=True, KV_SCALE=kv_scale)
    ptx = _compile_for_sm90(store_kv_kernel, io, dict(kv, HKV=8, BLOCK_H=8))
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    attn = dict(kv, F32_DOT=False, GROUP=4, BLOCK_N=64)
    _compile_for_sm90(decode_partial_kernel, io,
                      dict(attn, BLOCK_H=16, DIRECT=False, HAS_PREFIX=True))
    for warps in (1, 2, 4):  # pick_decode_cfg's warp counts
        ptx = _compile_for_sm90(decode_partial_kernel, io,
                                dict(attn, BLOCK_H=16, DIRECT=True, STORE_KV=True),
                                num_warps=warps)
        # pool K/V go to float16 two at a time, never through float16 -> bfloat16 (one
        # quarter-rate conversion per value, which made the fp8 pool decode no faster)
        assert "cvt.rn.f16x2.e4m3x2" in ptx, warps
        assert not re.search(r"cvt(\.rn)?\.bf16\.f16", ptx), warps
    _compile_for_sm90(prefix_attn_kernel, io, dict(attn, HKV=8, BLOCK_M=64))
    ptx = _compile_for_sm90(extend_kernel, io, dict(attn, BLOCK_M=64))
    # the new tokens come rounded by the store: extend never encodes float8 itself
    assert "satfinite.e4m3" not in ptx


# ------------------------------------------------------------------ the engine (CUDA)
def _prompts(seed: int) -> list[list[int]]:
    """Three groups of six prompts sharing a 70-token system prompt (grouped decode), and
    unrelated prompts of 3..120 tokens (chunked prefill at 64: extend over a cached prefix)."""
    r = random.Random(seed)
    ps = []
    for _ in range(3):
        system = [r.randint(3, 700) for _ in range(70)]
        ps += [system + [r.randint(3, 700) for _ in range(r.randint(1, 9))] for _ in range(6)]
    ps += [[r.randint(3, 700) for _ in range(r.randint(3, 120))] for _ in range(6)]
    return ps


def _engine(path: str, backend: str, dtype: str, kv: str, graphs: bool):
    from engine import LLM

    llm = LLM(model=path, dtype=dtype, device="cuda", kv_cache_dtype=kv,
              attention_backend=backend, enable_cuda_graph=graphs, cuda_graph_max_bs=32,
              chunked_prefill_size=64, max_total_tokens=8192, prefix_group_min_tokens=32)
    grouper = llm.engine.runner.prefix_grouper
    if grouper is not None:
        grouper.min_saved_tokens = 0  # the tiny model's prefixes are far below the default
    return llm


def _generate(llm, ps, max_tokens: int = 16):
    from engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=True)
    llm.generate(ps[::6], params)  # caches the system prompts: the batch then shares them
    return llm.generate(ps, params)


@pytest.mark.parametrize("graphs", [True, False])
@cuda[0]
@cuda[1]
def test_engine_fp8_kv_triton_matches_torch_fp8(tiny_llama, graphs):
    ps = _prompts(5)
    triton_llm = _engine(tiny_llama, "triton", "float32", "fp8_e4m3", graphs)
    assert triton_llm.engine.runner.kv_pool.fp8
    ours = _generate(triton_llm, ps)
    grouper = triton_llm.engine.runner.prefix_grouper
    assert grouper is not None and grouper.grouped_steps > 0
    ref = _generate(_engine(tiny_llama, "torch", "float32", "fp8_e4m3", False), ps)
    for a, b in zip(ours, ref):
        assert a.token_ids == b.token_ids
        diff = max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs))
        assert diff < 1e-2, diff


@cuda[0]
@cuda[1]
def test_engine_fp8_kv_triton_logprobs_close_to_bf16_pool(tiny_llama):
    from engine import SamplingParams

    ps = _prompts(6)
    ours = _generate(_engine(tiny_llama, "triton", "bfloat16", "fp8_e4m3", True), ps)
    bf16 = _engine(tiny_llama, "triton", "bfloat16", "auto", True)
    # the bf16 pool scores the fp8 run's own tokens (teacher forcing: same contexts)
    diffs = []
    for o in ours:
        scored = bf16.generate([o.prompt_token_ids + o.token_ids], SamplingParams(
            max_tokens=1, temperature=0.0, prompt_logprobs_start=len(o.prompt_token_ids)))[0]
        ref = scored.prompt_logprobs[len(o.prompt_token_ids):]
        diffs += [abs(x - y) for x, y in zip(o.logprobs, ref, strict=True)]
    mean = sum(diffs) / len(diffs)
    print(f"fp8 KV (Triton) vs bf16 pool: mean |dlogprob| {mean:.4f}, max {max(diffs):.4f}")
    assert 0 < mean < 0.5
