"""The absorbed-weight MLA decode kernel (engine/kernels/attention/mla_decode.py) against
softmax attention over the same latents in torch: ragged lengths (1 token, one tile, many
splits), scattered slots, padded head blocks, and the graph-mode bound (splits sized by the
context limit rather than the step's longest request).
An engine whose decode steps, and its mixed steps' leading decoders (8-token prefill chunks:
one prompt decodes while the other is still prefilled), go through the kernel
(attention_backend="triton", no graphs) gives the torch backend's greedy tokens and logprobs
on a tiny DeepSeek-V3.
`TRITON_INTERPRET=1` runs these on the CPU (tests/test_deepseek.py does, float32 only: the
interpreter's bf16 dot is not the GPU's)."""
from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else ("cpu" if INTERPRET else None)
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU (or TRITON_INTERPRET=1)")]

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory, tiny_llama) -> str:
    from deepseek_models import deepseek_v3_dir

    return deepseek_v3_dir(tmp_path_factory.mktemp("deepseek_v3"), tiny_llama)


def reference(q_lat, q_rope, cache, req_to_token, rows, lens, scale, c):
    out = torch.empty_like(q_lat, dtype=torch.float32)
    for b, (row, n) in enumerate(zip(rows.tolist(), lens.tolist())):
        kv = cache[req_to_token[row, :n].long(), 0].float()
        logits = (q_lat[b].float() @ kv[:, :c].T + q_rope[b].float() @ kv[:, c:].T) * scale
        out[b] = torch.softmax(logits, dim=-1) @ kv[:, :c]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,graph_bound", [(4, False), (20, True)])
def test_mla_decode_matches_torch(dtype, heads, graph_bound):
    if INTERPRET and dtype != torch.float32:
        pytest.skip("the interpreter's bf16 dot differs from the GPU's")
    from engine.kernels.attention.mla_decode import mla_decode

    gen = torch.Generator().manual_seed(0)
    c, r, slots, context = 64, 16, 600, 300
    lens = torch.tensor([1, 31, 33, 170])
    cache = torch.randn(slots + 1, 1, c + r, generator=gen).to(dtype)
    req_to_token = torch.zeros(6, context, dtype=torch.int32)
    rows = torch.tensor([2, 5, 1, 3])
    perm = torch.randperm(slots, generator=gen) + 1
    for row, n in zip(rows.tolist(), lens.tolist()):
        req_to_token[row, :n] = perm[:n].to(torch.int32)
        perm = perm[n:]
    q_lat = torch.randn(4, heads, c, generator=gen).to(dtype)
    q_rope = torch.randn(4, heads, r, generator=gen).to(dtype)
    scale = 0.11
    want = reference(q_lat, q_rope, cache, req_to_token, rows, lens, scale, c)
    to = dict(device=DEVICE)
    got = mla_decode(q_lat.to(**to), q_rope.to(**to), cache.to(**to), req_to_token.to(**to),
                     rows.to(**to), lens.to(dtype=torch.int32, **to), scale, c,
                     context if graph_bound else int(lens.max()))
    assert got.dtype == dtype
    torch.testing.assert_close(got.float().cpu(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_engine_decodes_through_the_kernel(v3_dir):
    from engine import LLM, SamplingParams

    prompts = [[7, 8, 9, 10, 11] * 3, list(range(40, 70))]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=v3_dir, dtype="float32", device=DEVICE, attention_backend=backend,
                  enable_cuda_graph=False, max_total_tokens=512, chunked_prefill_size=8)
        assert llm.engine.runner.attn_backend.triton_decode == (backend == "triton")
        outs[backend] = llm.generate(prompts, params)
    for ours, ref in zip(outs["triton"], outs["torch"]):
        assert ours.token_ids == ref.token_ids
        assert ours.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
