"""L2 prefetch of decode weights (engine/layers/l2_prefetch.py): the setting, where the model
asks for which weight, the kernel compiled for Hopper, and (`-m gpu`) a step with the
prefetches on giving bit-identical tokens and logprobs."""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers import l2_prefetch
from triton_on_cpu import compile_for_sm90

MB = 1 << 20


def test_setting_parses_targets_and_refuses_others():
    assert l2_prefetch.parse_targets(None) == {}
    assert l2_prefetch.parse_targets("0") == {}
    assert l2_prefetch.parse_targets("o:64, qkv:8,gate_up:0.5") == {
        "o": 64 * MB, "qkv": 8 * MB, "gate_up": MB // 2}
    for bad in ("down:8", "o", "o:", "all:4"):
        with pytest.raises(ValueError, match="RADIXSERVE_L2_PREFETCH"):
            l2_prefetch.parse_targets(bad)


def test_kernel_compiles_for_hopper_with_one_bulk_prefetch_per_chunk_after_the_pdl_wait():
    ptx = compile_for_sm90(l2_prefetch._prefetch_kernel, {"W": "*u8", "nbytes": "i64"},
                           {"CHUNK": 16 << 10, "PER_PROGRAM": 128})
    body = ptx[ptx.index(".entry"):]
    assert body.count("cp.async.bulk.prefetch.L2.global") == 1  # one per lane, 128 lanes
    assert ".reqntid 128" in body
    # compile_for_sm90 also checked that griddepcontrol.wait comes before it


def _record_prefetches(monkeypatch, targets):
    calls = []
    monkeypatch.setattr(l2_prefetch, "TARGETS", targets)
    monkeypatch.setattr(l2_prefetch, "prefetch_l2",
                        lambda weight, nbytes: calls.append((weight.data_ptr(), nbytes)))
    return calls


def test_model_asks_for_each_layers_weights_in_order_on_decode_sized_steps(
        tiny_model_factory, monkeypatch):
    path = tiny_model_factory("llama")
    llm = LLM(model=path, dtype="float32", device="cpu", max_total_tokens=2048)
    layers = llm.engine.runner.model.model.layers
    calls = _record_prefetches(monkeypatch, {"qkv": 3 * MB, "o": MB, "gate_up": 2 * MB})
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm.generate([[5, 6, 7, 8]], params)  # a 4-token prefill, then decode steps: all <= MAX_ROWS
    expected = []
    for layer in layers:
        expected += [(layer.self_attn.qkv_proj.weight.data_ptr(), 3 * MB),
                     (layer.self_attn.o_proj.weight.data_ptr(), MB),
                     (layer.mlp.gate_up_proj.weight.data_ptr(), 2 * MB)]
    assert len(layers) >= 2 and calls == expected * 3  # three steps

    calls.clear()
    long_prompt = list(range(3, 3 + l2_prefetch.MAX_ROWS + 1))
    llm.generate([long_prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    assert calls == []  # a GEMM-sized step reuses weight tiles across rows: no prefetch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_prefetch_changes_no_token_or_logprob(tiny_model_factory, monkeypatch, quantization):
    """A prefetch only moves bytes into L2: batch-1 greedy tokens and their logprobs, CUDA
    graphs on, equal bit for bit those without it."""
    path = tiny_model_factory("llama", hidden_size=512, intermediate_size=1024)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    r = random.Random(3)
    prompts = [[r.randint(3, 700) for _ in range(r.randint(5, 40))] for _ in range(3)]
    results = {}
    for targets in ({}, {"qkv": 8 * MB, "o": 64 * MB, "gate_up": MB}):
        monkeypatch.setattr(l2_prefetch, "TARGETS", targets)
        llm = LLM(model=path, dtype="bfloat16", device="cuda", max_total_tokens=4096,
                  quantization=quantization, cuda_graph_max_bs=4)
        outs = [llm.generate([p], params)[0] for p in prompts]  # batch 1
        results[bool(targets)] = [(o.token_ids, o.logprobs, o.top_logprobs) for o in outs]
        del llm
    assert results[True] == results[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prefetch_kernel_runs_inside_a_cuda_graph():
    """The launch itself on the GPU (the engine captures it into its decode graphs), for a
    size that ends inside a chunk and one smaller than a chunk."""
    weight = torch.randn(4096, 1000, device="cuda", dtype=torch.bfloat16)
    before = weight.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        l2_prefetch.prefetch_l2(weight, 5 * MB + 48)
        l2_prefetch.prefetch_l2(weight, 1000)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(weight, before)


@pytest.mark.parametrize("fused", [False, True])
def test_benchmarks_waiting_kernel_compiles_for_hopper(fused):
    """scripts/bench_l2_prefetch.py's stand-in for the idle stretch, with the prefetch fused
    into it or not: the next device session's first call depends on it."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from bench_l2_prefetch import _wait_kernel

    ptx = compile_for_sm90(_wait_kernel, {"Sink": "*i64", "nanoseconds": "i64", "W": "*u8",
                                          "nbytes": "i64"},
                           {"FUSED": fused, "CHUNK": 16 << 10, "PER_PROGRAM": 128})
    assert "%globaltimer" in ptx
    assert ("cp.async.bulk.prefetch.L2.global" in ptx) == fused
