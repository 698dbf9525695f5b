"""The whole engine on a GPU (Triton attention, CUDA graphs) against HF transformers.
Runs with `pytest -m gpu` on a CUDA machine; skipped elsewhere."""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine_steps import never_syncing, run_with_arrivals
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
    on = LLM(model=tiny_llama, dtype="float32", device="cuda", max_total_tokens=160,
             cuda_graph_max_bs=16)
    off = LLM(model=tiny_llama, dtype="float32", device="cuda", max_total_tokens=4096,
              enable_radix_cache=False, cuda_graph_max_bs=16)
    a, b = on.generate(ps, params), off.generate(ps, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert on.stats()["cached_tokens"] > 0
    assert on.stats()["preemptions"] > 0


def test_overlap_on_off_identical_with_mixed_requests(tiny_llama):
    ps = prompts(20, 3, 100, seed=4)
    params = [SamplingParams(max_tokens=1 + (i * 7) % 30, temperature=0.0, ignore_eos=True,
                             logprobs=(i % 5 == 0), stop_token_ids=[(i * 13) % 700])
              for i in range(len(ps))]
    outs = {}
    for overlap in (True, False):
        llm = LLM(model=tiny_llama, dtype="float32", device="cuda", max_total_tokens=600,
                  enable_overlap_schedule=overlap, cuda_graph_max_bs=16, chunked_prefill_size=48)
        outs[overlap] = llm.generate(ps, params)
        s = llm.stats()
        assert s["free_slots"] + s["evictable_slots"] == s["total_slots"]
    for a, b in zip(outs[True], outs[False]):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert all(t >= 0 for t in a.token_ids)


@pytest.mark.parametrize("graphs", [True, False])
def test_overlap_launches_a_step_without_waiting_for_the_gpu(tiny_llama, monkeypatch, graphs):
    """Under the overlap scheduler the host plans, launches and samples step N+1 while the
    GPU runs step N: nothing in between may synchronize with the GPU (a list index or
    `torch.tensor(..., device=cuda)` copies from pageable memory and waits for the stream).
    Mixed steps with chunks that do not sample, greedy and sampled rows, seeded or not,
    top-k/top-p/min-p, penalties, logit_bias, min_tokens, logprobs, prompt logprobs: every launch and sampling call runs under torch's sync debug mode,
    which raises on any synchronizing call."""
    from engine.runtime.overlap import OverlapStepper

    for name in ("_forward", "_sample"):
        monkeypatch.setattr(OverlapStepper, name, never_syncing(getattr(OverlapStepper, name)))
    llm = LLM(model=tiny_llama, dtype="float32", device="cuda", max_total_tokens=4096,
              enable_cuda_graph=graphs, cuda_graph_max_bs=16, chunked_prefill_size=48)
    assert isinstance(llm.engine.stepper, OverlapStepper)
    ps = prompts(24, 3, 150, seed=11)
    params = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
              if i % 3 == 0 else
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, top_p=0.9,
                             top_k=20 if i % 2 else -1, min_p=0.05 if i % 4 == 1 else 0.0,
                             seed=i if i % 5 == 1 else None,
                             repetition_penalty=1.2 if i % 4 == 2 else 1.0,
                             frequency_penalty=0.5 if i % 8 == 5 else 0.0,
                             logit_bias={7: 2.0} if i % 8 == 1 else None,
                             min_tokens=3 if i % 7 == 4 else 0,
                             logprobs=i % 6 == 1, top_logprobs=2 if i % 12 == 1 else 0,
                             prompt_logprobs_start=0 if i % 9 == 4 else None)
              for i in range(len(ps))]
    outs = llm.generate(ps, params)
    assert [len(o.token_ids) for o in outs] == [12] * len(ps)
    greedy = LLM(model=tiny_llama, dtype="float32", device="cuda", max_total_tokens=4096,
                 enable_overlap_schedule=False, cuda_graph_max_bs=16, chunked_prefill_size=48)
    want = greedy.generate([ps[i] for i in range(0, len(ps), 3)], params[0])
    assert [o.token_ids for o in want] == [outs[i].token_ids for i in range(0, len(ps), 3)]


def test_overlap_abort_mid_flight(tiny_llama):
    from engine import AsyncEngine, EngineConfig
    from test_overlap import abort_mid_stream

    eng = AsyncEngine(EngineConfig(model=tiny_llama, dtype="float32", device="cuda",
                                   max_total_tokens=2048, cuda_graph_max_bs=8))
    got, stats = abort_mid_stream(eng, [5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True,
                                                                  temperature=0.0))
    assert got[-1].finish_reason == "abort" and all(t >= 0 for d in got for t in d.token_ids)
    assert stats["running"] == 0 and stats["free_slots"] + stats["evictable_slots"] == stats["total_slots"]


@pytest.mark.parametrize("graphs", [True, False])
def test_grouped_decode_matches_plain_and_hf(tiny_llama, graphs):
    """Radix-grouped decode (shared prefixes attended once per group) on real engine steps:
    greedy outputs equal plain decode and HF; the grouper really planned groups."""
    r = random.Random(4)
    ps = []
    for _ in range(3):
        system = [r.randint(3, 700) for _ in range(70)]
        ps += [system + [r.randint(3, 700) for _ in range(r.randint(1, 9))] for _ in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    kw = dict(model=tiny_llama, dtype="float32", device="cuda", max_total_tokens=8192,
              enable_cuda_graph=graphs, cuda_graph_max_bs=32)
    grouped = LLM(prefix_group_min_tokens=32, **kw)
    grouper = grouped.engine.runner.prefix_grouper
    grouper.min_saved_tokens = 0  # the tiny model's prefixes are far below the default
    grouped.generate(ps[::6], params)  # cache each system prompt: the batch then shares them
    a = grouped.generate(ps, params)
    b = LLM(enable_prefix_grouped_decode=False, **kw).generate(ps, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert grouper.grouped_steps > 0
    for o in a[:4]:
        assert o.token_ids == hf_greedy(tiny_llama, o.prompt_token_ids, 12)


def test_gpu_structured_output_validates_and_matches_cpu(tiny_llama):
    """Masks built on the host, uploaded without blocking, applied on the GPU: every output
    that stops validates, and greedy constrained outputs equal the CPU engine's."""
    pytest.importorskip("xgrammar", reason="carry the xgrammar wheel to the GPU machine")
    from test_structured import PROMPTS, REGEXES, SCHEMAS, check_json, check_regex

    cases = [dict(json_schema=s) for s in SCHEMAS] + [dict(regex=r) for r in REGEXES]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(cases))]
    params = [SamplingParams(max_tokens=120, temperature=0.0, **c) for c in cases]
    outs, llms = {}, {}
    for device in ("cuda", "cpu"):
        llms[device] = LLM(model=tiny_llama, dtype="float32", device=device,
                           max_total_tokens=16384, cuda_graph_max_bs=64)
        outs[device] = llms[device].generate(prompts, params)
    gpu = outs["cuda"]
    n = len(SCHEMAS)
    stopped = (check_json(llms["cuda"], gpu[:n], params[:n], SCHEMAS)
               + check_regex(llms["cuda"], gpu[n:], params[n:], REGEXES))
    assert stopped >= 0.9 * len(cases)
    for a, b in zip(gpu, outs["cpu"]):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason


def test_gpu_overlap_with_structured_output(tiny_llama):
    """Constrained requests stay overlapped (jump-forward off): outputs equal sync stepping."""
    pytest.importorskip("xgrammar", reason="carry the xgrammar wheel to the GPU machine")
    from test_overlap import mixed_batch

    prompts, params = mixed_batch(seed=1)
    outs = {}
    for overlap in (True, False):
        llm = LLM(model=tiny_llama, dtype="float32", device="cuda", max_total_tokens=8192,
                  enable_overlap_schedule=overlap, enable_jump_forward=False,
                  cuda_graph_max_bs=32, chunked_prefill_size=64)
        outs[overlap] = llm.generate(prompts, params)
    for a, b in zip(outs[True], outs[False]):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason


def test_extend_graphs_match_eager(tiny_llama):
    """Short prefills replay CUDA graphs (padded tokens and requests) and give the same
    tokens and logprobs as eager prefill: fresh prompts, prompts extending a cached
    prefix, several requests per step, and steps too large for any graph (eager)."""
    base = prompts(1, 70, 70, seed=7)[0]
    ps = prompts(6, 1, 40, seed=8) + [base + p for p in prompts(6, 1, 20, seed=9)]
    ps += prompts(2, 300, 400, seed=10)  # over the 256-token limit below: eager
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
    runs = {}
    for limit in (256, 0):
        llm = LLM(model=tiny_llama, dtype="float32", device="cuda", max_total_tokens=8192,
                  cuda_graph_max_bs=16, cuda_graph_max_extend_tokens=limit,
                  cuda_graph_max_extend_bs=4, chunked_prefill_size=512)
        # Steps of <= 4 requests and <= 256 new tokens replay a graph: the first prompt,
        # then groups of three (fresh prompts; prompts extending `base`, cached by then).
        # The last group (two long prompts) runs eagerly.
        groups = [[base], ps[:3], ps[3:6], ps[6:9], ps[9:12], ps[12:]]
        runs[limit] = [o for g in groups for o in llm.generate(g, params)]
        graphs = llm.engine.runner.graphs
        if limit:
            assert graphs.extend_replays >= 5
        else:
            assert graphs.max_extend_tokens == 0 and graphs.extend_replays == 0
    for a, b in zip(runs[256], runs[0]):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x - y) < 1e-4


def test_extend_graphs_with_decoders_match_eager(tiny_llama):
    """Mixed steps small enough for an extend graph: requests still decoding when short
    prompts arrive. The graph finds the decoders on the device (they take the decode kernel,
    wherever they sit in the step); tokens equal eager extends', logprobs within 1e-4."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True)
    ps = prompts(6, 20, 60, seed=12)
    arrivals = [0, 0, 0, 3, 5, 6]  # engine steps at which each prompt arrives
    runs = {}
    for limit in (256, 0):
        llm = LLM(model=tiny_llama, dtype="float32", device="cuda", max_total_tokens=8192,
                  cuda_graph_max_bs=16, cuda_graph_max_extend_tokens=limit,
                  cuda_graph_max_extend_bs=8, chunked_prefill_size=512)
        runs[limit] = run_with_arrivals(llm.engine, ps, arrivals, params)
        if limit:
            assert llm.engine.runner.graphs.extend_replays >= 4
    for (ids_g, lp_g), (ids_e, lp_e) in zip(runs[256], runs[0]):
        assert ids_g == ids_e
        assert max(abs(x - y) for x, y in zip(lp_g, lp_e)) < 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_split_sums_change_no_token(tiny_model_factory, arch, quantization):
    """Batch-1 linears wide enough for the GEMV to cut K (hidden 512, MLP 1024) hand their
    partial sums to RMSNorm, SiLU-and-mul and RoPE (engine/kernels/split_sums.py): greedy
    tokens and their logprobs equal, bit for bit, those of the GEMV summing them itself."""
    path = tiny_model_factory(arch, hidden_size=512, intermediate_size=1024)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    results = {}
    for keep in (True, False):
        llm = LLM(model=path, dtype="bfloat16", device="cuda", max_total_tokens=4096,
                  quantization=quantization, cuda_graph_max_bs=4, kernels={"split_sums": keep})
        outs = [llm.generate([p], params)[0] for p in prompts(3, 5, 40, seed=2)]  # batch 1
        results[keep] = [(o.token_ids, o.logprobs, o.top_logprobs) for o in outs]
        del llm
    assert results[True] == results[False]
