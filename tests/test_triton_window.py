"""Sliding-window attention in the Triton kernels (decode, extend) against the torch backend's
windows. Marked `gpu` like tests/test_triton_attention.py, whose random steps it reuses:
CUDA runs them on the GPU; `TRITON_INTERPRET=1` runs them on the CPU (shapes shrunk)."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.kv_pool import KVPool
from engine.quantization.fp8 import FP8
from test_triton_attention import DEVICE, DT, compare, decode_reqs, extend_reqs, make_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU (or TRITON_INTERPRET=1)"),
]


def check_window(reqs, hq, hkv, d, dtype, window, *, seed=0, pad_to=0, kv_dtype=None,
                 **backend_kw) -> dict:
    from engine.attention.triton_backend import TritonAttentionBackend

    case = make_case(reqs, hq, hkv, d, dtype, DEVICE, seed=seed, pad_to=pad_to, kv_dtype=kv_dtype)
    scale = 1.0 / math.sqrt(d)
    if case.pool.fp8:  # as test_triton_attention.reference: the same float8 pool, copied
        ref_pool = copy.copy(case.pool)
        ref_pool.k, ref_pool.v = [t.clone() for t in case.pool.k], [t.clone() for t in case.pool.v]
    else:
        ref_pool = KVPool.over([t.float().clone() for t in case.pool.k],
                               [t.float().clone() for t in case.pool.v])
    ref_backend = TorchAttentionBackend(ref_pool, scale)
    ref_backend.set_sliding_windows({case.layer: window})
    ref = ref_backend.forward(case.q.float(), case.k.float(), case.v.float(), case.layer, case.batch)
    backend = TritonAttentionBackend(case.pool, scale, **backend_kw)
    backend.set_sliding_windows({case.layer: window, 0: 1})  # another layer's window: unused
    backend.prepare(case.batch)
    out = torch.full(case.q.shape, float("nan"), dtype=dtype, device=case.q.device)
    backend.forward(case.q, case.k, case.v, case.layer, case.batch, out=out)
    return compare(case, out, ref, ref_pool)


# (name, bsz, max_len, hq, hkv, d, dtype, window, backend kwargs)
DECODE_CASES = [
    ("b7_w64", 7, 3000, 16, 4, 128, "bf16", 64, {}),
    ("b7_w100_fp32", 7, 2000, 8, 2, 64, "fp32", 100, {}),
    ("b7_w1", 7, 500, 8, 2, 64, "fp32", 1, {}),  # only the token itself
    ("b7_w1000_splits3", 7, 3000, 16, 4, 128, "bf16", 1000, {"force_num_splits": 3}),
    ("b7_w37_splits8", 7, 3000, 8, 2, 64, "fp32", 37, {"force_num_splits": 8}),
    ("b7_w300_graphmode", 7, 3000, 16, 4, 64, "bf16", 300, {"graph_mode": True}),
]

# (name, [(prefix, extend)], hq, hkv, d, dtype, window): windows shorter than the prefix,
# than one tile, and longer than everything
EXTEND_CASES = [
    ("prefix_mix_w50", [(100, 50), (0, 129), (2000, 1), (17, 64)], 16, 4, 64, "fp32", 50),
    ("long_prefix_w300", [(3000, 128)], 32, 8, 128, "bf16", 300),
    ("ragged_w7", [(0, 1), (40, 300), (300, 5)], 8, 2, 64, "fp32", 7),
    ("chunks_w129", [(256, 256), (1, 255)], 16, 2, 128, "bf16", 129),
    ("w_beyond_all", [(70, 90), (3, 1)], 4, 2, 80, "fp32", 10000),
    # a mixed step: leading decoders (the decode kernel, windowed) with long contexts
    ("mixed_decoders_w64", [(500, 1), (90, 1), (1500, 1), (0, 200)], 16, 4, 64, "bf16", 64),
]


@pytest.mark.parametrize("i", range(len(DECODE_CASES)), ids=[c[0] for c in DECODE_CASES])
def test_decode_window(i):
    name, bsz, max_len, hq, hkv, d, dt, window, kw = DECODE_CASES[i]
    r = check_window(decode_reqs(bsz, max_len, 400 + i), hq, hkv, d, DT[dt], window,
                     seed=400 + i, **kw)
    assert r["ok"], r


@pytest.mark.parametrize("i", range(len(EXTEND_CASES)), ids=[c[0] for c in EXTEND_CASES])
def test_extend_window(i):
    name, reqs, hq, hkv, d, dt, window = EXTEND_CASES[i]
    if DEVICE == "cpu":
        window = min(window, 40)  # the interpreter's shapes are shrunk: keep windows shorter
    r = check_window(extend_reqs(reqs), hq, hkv, d, DT[dt], window, seed=500 + i)
    assert r["ok"], r


@pytest.mark.parametrize("step", ["decode", "extend"])
def test_window_with_fp8_pool(step):
    """WINDOW and KV_FP8 together (the two constexprs are independent)."""
    reqs = decode_reqs(7, 2000, 9) if step == "decode" else extend_reqs([(100, 50), (0, 129), (17, 64)])
    r = check_window(reqs, 16, 4, 64, torch.bfloat16, 33, seed=9, kv_dtype=FP8)
    assert r["ok"], r


def test_decode_window_graph_padding():
    r = check_window(decode_reqs(5, 2000, 7), 16, 4, 128, torch.bfloat16, 33, seed=7, pad_to=12)
    assert r["ok"], r


@pytest.mark.parametrize("arch,overrides", [
    ("mistral", {"sliding_window": 8}),  # every layer
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),  # layer 1
])
def test_engine_with_triton_windows_equals_hf(tiny_model_factory, arch, overrides):
    """Tiny models with a window of 8 through the whole engine on the Triton backend (prefill
    chunks, decode, radix-grouped decode: windowed layers decode plainly, full ones grouped),
    greedy equal to HF past the window."""
    from engine import LLM, SamplingParams
    from hf_reference import hf_greedy
    from test_models import random_sequences

    path = tiny_model_factory(arch, **overrides)
    llm = LLM(model=path, dtype="float32", device=DEVICE, attention_backend="triton",
              max_total_tokens=1024, chunked_prefill_size=16, prefix_group_min_tokens=8)
    grouper = llm.engine.runner.prefix_grouper
    grouper.min_saved_tokens = 0  # the tiny prefixes are far below the default
    shared = random_sequences(768, [20], seed=7)[0]
    llm.generate([shared], SamplingParams(max_tokens=1))  # cache it: the batch then shares it
    # 16 requests on the shared prefix: the batch reaches the grouped decode graphs (>= 16)
    prompts = random_sequences(768, [5, 20], seed=6) + [shared + [9 + i] for i in range(16)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, 12) for p in prompts]
    assert grouper.grouped_steps > 0
