"""The whole engine on a GPU (Triton attention, CUDA graphs) against HF transformers.
Runs with `pytest -m gpu` on a CUDA machine; skipped elsewhere."""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from hf_reference import hf_greedy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def prompts(n, lo, hi, seed):
    r = random.Random(seed)
    return [[r.randint(3, 700) for _ in range(r.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_greedy_matches_hf(tiny_model_factory, arch, graphs):
    path = tiny_model_factory(arch)
    llm = LLM(model=path, dtype="float32", device="cuda", max_total_tokens=8192,
              enable_cuda_graph=graphs, cuda_graph_max_bs=32, chunked_prefill_size=64)
    ps = prompts(12, 3, 120, seed=1)
    outs = llm.generate(ps, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for o in outs:
        assert o.token_ids == hf_greedy(path, o.prompt_token_ids, 16)


def test_gpu_cache_on_off_and_preemption(tiny_llama):
    base = prompts(1, 80, 80, seed=2)[0]
    ps = [base + p for p in prompts(10, 1, 30, seed=3)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    on = LLM(model=tiny_llama, dtype="float32", device="cuda", max_total_tokens=400,
             cuda_graph_max_bs=16)
    off = LLM(model=tiny_llama, dtype="float32", device="cuda", max_total_tokens=4096,
              enable_radix_cache=False, cuda_graph_max_bs=16)
    a, b = on.generate(ps, params), off.generate(ps, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert on.stats()["cached_tokens"] > 0
    assert on.stats()["preemptions"] > 0
