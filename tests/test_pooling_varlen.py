"""The packed (varlen) attention of the pooling tasks: engine/kernels/attention/varlen.py's
Triton kernel against the padded torch path (engine/attention/varlen.py), encoders'
bidirectional and decoders' causal attention, with GQA and head dims that are and are not
powers of two. The `gpu` tests run on a GPU, and on the CPU through Triton's interpreter;
the host-side packing (engine/runtime/pooling_batch.py) is checked here directly."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine import EngineConfig, PoolingEngine
from engine.attention.varlen import PackedLayout, varlen_attention
from engine.loading.demo_model import ensure_demo_model
from engine.runtime.pooling_batch import forward_bounds, input_lens, pack_forward, plan_call, upload
from engine.runtime.pooling_input import PoolInput
from triton_on_cpu import compile_for_sm90, run_under_interpreter

CASES = [  # lens, q heads, kv heads, head dim, causal
    ([5, 64, 1, 130, 17], 4, 4, 32, False),
    ([70, 3, 129, 64], 4, 4, 24, False),
    ([9, 200, 65, 1], 8, 2, 64, True),
    ([128, 33, 2], 4, 1, 40, True),
]


def _device() -> torch.device:
    """The GPU, or the CPU under Triton's interpreter (a `gpu` test run any other way skips)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    return torch.device("cpu")


def _tiny_bert(root) -> str:
    """A random 2-layer BERT (4 heads of 16) with the demo model's tokenizer."""
    cfg = {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
           "vocab_size": 512, "max_position_embeddings": 512, "type_vocab_size": 2,
           "layer_norm_eps": 1e-12, "hidden_act": "gelu", "pad_token_id": 0}
    (root / "config.json").write_text(json.dumps(cfg))
    return str(root)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,hq,hkv,d,causal", CASES)
def test_triton_varlen_equals_the_padded_torch_path(lens, hq, hkv, d, causal, dtype):
    if _device().type == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the interpreter's bf16 dots are not what a GPU computes")
    device = _device()
    gen = torch.Generator().manual_seed(len(lens) * d)
    t = sum(lens)
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=gen).to(device, dtype)
    q, k, v = qkv.split([hq, hkv, hkv], dim=1)  # strided views, as a fused qkv gives them
    scale = d ** -0.5
    ours = varlen_attention(q, k, v, PackedLayout.of(lens, device, use_triton=True), causal, scale)
    ref = varlen_attention(q.float(), k.float(), v.float(), PackedLayout.of(lens, device),
                           causal, scale)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-4
    torch.testing.assert_close(ours.float(), ref, atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_engine_embeddings_equal_with_triton_and_torch_attention(kind, tiny_model_factory,
                                                                 tmp_path):
    """The whole pooling engine (packing, attention, pooling) with the Triton kernel
    against the padded torch path, on a batch of mixed lengths in float32."""
    device = _device()
    path = _tiny_bert(tmp_path) if kind == "encoder" else tiny_model_factory("qwen3")
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randint(5, 500, (n,), generator=gen).tolist()
              for n in (3, 150, 1, 64, 65, 20, 129, 7)]

    def embed(backend: str) -> torch.Tensor:
        engine = PoolingEngine(EngineConfig(
            model=path, task="embed", load_format="dummy", dtype="float32", device=device.type,
            tokenizer=ensure_demo_model(), attention_backend=backend, max_prefill_tokens=256))
        assert engine.use_triton == (backend == "triton")
        return engine.embed([PoolInput(ids) for ids in inputs])

    ours, ref = embed("triton"), embed("torch")
    assert ours.shape == ref.shape and ours.shape[0] == len(inputs)
    assert F.cosine_similarity(ours, ref).min().item() >= 0.99999


def test_triton_varlen_under_the_interpreter():
    pytest.importorskip("triton")
    run_under_interpreter("test_pooling_varlen.py", allow_skipped=True)


def test_varlen_kernel_compiles_for_hopper():
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend")
    from engine.kernels.attention.varlen import BLOCK_M, BLOCK_N, varlen_attention_kernel

    types = dict(Q="*bf16", K="*bf16", V="*bf16", Out="*bf16", CuSeqlens="*i32",
                 sm_scale_log2="fp32")
    for group, d, causal in ((1, 32, False), (1, 64, False), (4, 128, True)):
        compile_for_sm90(varlen_attention_kernel, types,
                         dict(GROUP=group, CAUSAL=causal, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                              HEAD_DIM=d, BLOCK_D=d, F32_DOT=False), num_stages=2)


def test_packing_sorts_cuts_and_keeps_positions():
    sizes = (5, 2, 9, 3, 2)
    items = [PoolInput([10 * i + j for j in range(n)], [1] * n if n == 3 else None)
             for i, n in enumerate(sizes)]
    plan = plan_call(items, input_lens(items), token_budget=7, max_seqs=8)
    assert plan.lens.tolist() == [2, 2, 3, 5, 9] and plan.order.tolist() == [1, 4, 3, 0, 2]
    assert plan.bounds == [(0, 3), (3, 4), (4, 5)] and plan.has_types
    host = pack_forward(items, plan, 0, 3)
    ids, positions, cu, types = np.split(host, [7, 14, 18])
    assert ids.tolist() == [10, 11, 40, 41, 30, 31, 32]
    assert positions.tolist() == [0, 1, 0, 1, 0, 1, 2] and cu.tolist() == [0, 2, 4, 7]
    assert types.tolist() == [0] * 4 + [1] * 3
    fwd = upload(host, plan.lens[0:3], True, torch.device("cpu"))
    assert fwd.cu_seqlens.dtype == torch.int32 and fwd.token_types.tolist() == types.tolist()
    assert forward_bounds(plan.lens, token_budget=100, max_seqs=2) == [(0, 2), (2, 4), (4, 5)]
    assert forward_bounds(np.array([50, 60]), token_budget=10, max_seqs=8) == [(0, 1), (1, 2)]


def test_bad_token_ids_are_value_errors(tmp_path):
    """Out of the vocabulary (past int64 too) or empty: a ValueError naming it, from the
    servers' up-front check and from a call whose bad input is in a later forward."""
    engine = PoolingEngine(EngineConfig(model=_tiny_bert(tmp_path), task="embed",
                                        load_format="dummy", dtype="float32", device="cpu",
                                        tokenizer=ensure_demo_model(), max_running_requests=2))
    good = [PoolInput([5] * n) for n in (3, 40, 60)]
    for bad in ([512], [-1], [2 ** 70], []):
        with pytest.raises(ValueError, match="token ids must be in|input is empty"):
            engine.check_all(good + [PoolInput(bad)])
        with pytest.raises(ValueError, match="token ids must be in|input is empty"):
            engine.embed(good + [PoolInput([7] * 50 + bad)] if bad else good + [PoolInput(bad)])
    assert engine.stats.inputs == 0
    assert engine.embed(good).shape == (3, 64) and engine.stats.inputs == 3
