"""Speculative decoding (n-gram drafts) on CPU: greedy outputs equal plain decoding and HF,
sampled outputs follow the target's distribution (chi-square), penalties and logprobs judged
per verified position, and random traffic with aborts and preemption leaks no KV."""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.runtime.engine import Engine, overlap_enabled
from engine.core.request import Request
from engine.speculative.ngram import NgramProposer
from engine.speculative.proposer import Proposer
from engine.speculative.verify import rejection_sample, verify_greedy
from hf_reference import hf_greedy, hf_top_k_tree
from test_overlap import assert_no_leak, drive_random_traffic, mixed_batch

GREEDY = dict(temperature=0.0, ignore_eos=True)
SPEC = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=4)
# chi-square quantiles at 1 - 1e-3 (fixed seeds make the tests deterministic; the margin
# keeps a correct sampler far from failing under a change of seed).
CHI2_999 = {3: 16.27, 15: 37.70}


@pytest.fixture(scope="module")
def looping_model(tiny_model_factory) -> str:
    """Small initial weights: greedy decoding soon repeats itself, a copy task for drafts."""
    return tiny_model_factory("llama", init_std=0.02)


def copy_prompts(n: int, seed: int) -> list[list[int]]:
    """Random token runs followed by the start of the same run again."""
    r = random.Random(seed)
    out = []
    for _ in range(n):
        base = [r.randint(3, 700) for _ in range(r.randint(10, 40))]
        out.append(base + base[:r.randint(3, 10)])
    return out


def spec_stats(llm) -> dict:
    return {k: v for k, v in llm.stats().items() if k.startswith("spec_")}


# -- pieces -------------------------------------------------------------------------------

def test_ngram_proposer_prefers_long_and_recent_matches():
    prop = NgramProposer(min_n=1, max_n=3)
    params = SamplingParams()
    req = Request("a", [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3], params)
    # Suffix [5, 2, 3] never occurred; [2, 3] did, latest before 7 (not before 9).
    assert prop.propose(req, 4) == [7, 8, 5, 2]
    req.token_ids += [7]  # the index grows incrementally with the tokens
    assert prop.propose(req, 2) == [8, 5]
    assert prop.propose(Request("b", [4, 5, 6], params), 3) == []
    assert prop.propose(Request("c", [4, 5, 4], params), 3) == [5, 4]  # runs to the end


def test_verify_greedy_keeps_the_matching_run():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 9]) == [5, 6, 7]
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]
    assert verify_greedy([4, 6], [5]) == [4]


def _chi2(counts: dict, expected: dict, n: int) -> float:
    return sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in expected.items())


@pytest.mark.parametrize("draft_kind", ["deterministic", "distribution"])
def test_rejection_sampling_emits_the_target_distribution(draft_kind):
    """The first emitted token follows p[0] whatever the draft. The test tells this from
    the classic bug (on rejection, draw from p instead of the residual max(0, p - q))."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]])
    q = torch.tensor([[0.6, 0.2, 0.1, 0.1], [0.1, 0.1, 0.1, 0.7]])
    if draft_kind == "deterministic":
        q = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])

    def draw(w):
        return int(torch.multinomial(w, 1, generator=gen))

    n, counts, kept = 6000, {}, 0
    for _ in range(n):
        draft = [draw(q[0]), draw(q[1])]
        q_arg = None if draft_kind == "deterministic" else q
        out = rejection_sample(p, draft, torch.rand(2, generator=gen), draw, q_arg)
        counts[out[0]] = counts.get(out[0], 0) + 1
        kept += out[0] == draft[0]
    expected = {i: float(p[0, i]) for i in range(4)}
    assert _chi2(counts, expected, n) < CHI2_999[3]
    assert 0 < kept < n
    overlap = torch.minimum(p[0], q[0])
    buggy = overlap + (1 - overlap.sum()) * p[0]
    assert _chi2(counts, {i: float(buggy[i]) for i in range(4)}, n) > 10 * CHI2_999[3]


# -- greedy: token for token ----------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_equals_plain_decoding_and_hf(tiny_model_factory, arch):
    path = tiny_model_factory(arch, init_std=0.02)
    prompts = copy_prompts(5, seed=1)
    params = SamplingParams(max_tokens=60, **GREEDY)
    plain = LLM(model=path, dtype="float32", max_total_tokens=4096).generate(prompts, params)
    llm = LLM(model=path, dtype="float32", max_total_tokens=4096, **SPEC)
    spec = llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec[0].token_ids == hf_greedy(path, prompts[0], 60)
    stats = spec_stats(llm)
    assert stats["spec_accepted_tokens"] > 0, stats
    assert llm.stats()["steps"] < 60 + 1  # fewer forwards than one per output token
    assert_no_leak(llm.stats())


def test_copy_task_acceptance_and_stats(looping_model):
    """N-gram drafts pay off once the output repeats: more than one token per forward."""
    llm = LLM(model=looping_model, dtype="float32", max_total_tokens=4096, **SPEC)
    outs = llm.generate(copy_prompts(6, seed=0), SamplingParams(max_tokens=150, **GREEDY))
    s = llm.stats()
    assert s["spec_accepted_tokens"] > 0
    assert 0 < s["spec_acceptance_rate"] <= 1
    assert s["spec_mean_acceptance_length"] > 1.5
    assert s["steps"] < 0.8 * 150  # plain decoding: one prefill step + 149 decode steps
    per_request = [o.speculative for o in outs]
    assert sum(r["spec_accepted_tokens"] for r in per_request) == s["spec_accepted_tokens"]
    assert sum(r["spec_drafted_tokens"] for r in per_request) == s["spec_drafted_tokens"]


def test_chunked_prefill_stops_and_preemption_equal_plain(looping_model):
    """A pool small enough to retract, chunked prefill, stop strings and stop tokens,
    EOS on, varied max_tokens: speculative outputs equal plain decoding."""
    r = random.Random(4)
    prompts = copy_prompts(10, seed=4) + ["The old lighthouse stood", "Numbers are everywhere"]
    params = [SamplingParams(max_tokens=r.randint(1, 70), temperature=0.0,
                             ignore_eos=bool(i % 2), stop_token_ids=[r.randint(3, 700)])
              for i in range(10)]
    params += [SamplingParams(max_tokens=80, temperature=0.0, stop=["e"]),
               SamplingParams(max_tokens=80, temperature=0.0, stop=["the b", "xq"])]
    kw = dict(model=looping_model, dtype="float32", max_total_tokens=260, chunked_prefill_size=16)
    plain = LLM(**kw).generate(prompts, params)
    llm = LLM(**kw, **SPEC)
    spec = llm.generate(prompts, params)
    for a, b in zip(spec, plain):
        assert (a.token_ids, a.finish_reason, a.text) == (b.token_ids, b.finish_reason, b.text)
    s = llm.stats()
    assert s["preemptions"] > 0 and s["spec_accepted_tokens"] > 0
    assert_no_leak(s)


def test_penalties_and_logprobs_speculate_and_equal_plain(looping_model):
    """Penalties (repetition, frequency, presence), logit_bias and min_tokens are applied at
    every verified position counting the drafts before it, so their outputs equal plain
    decoding's; logprobs are the target's at each kept token's position, as plain decoding
    reports them. (Structured output: tests/test_speculative_constrained.py.)"""
    prompt = copy_prompts(1, seed=7)[0]
    params = [SamplingParams(max_tokens=60, logprobs=True, top_logprobs=3, **GREEDY),
              SamplingParams(max_tokens=60, repetition_penalty=1.3, **GREEDY),
              SamplingParams(max_tokens=60, frequency_penalty=0.5, presence_penalty=0.3, **GREEDY),
              SamplingParams(max_tokens=60, logit_bias={prompt[3]: 2.5, prompt[5]: -5.0}, **GREEDY),
              SamplingParams(max_tokens=60, min_tokens=40, temperature=0.0, stop_token_ids=[prompt[4]]),
              SamplingParams(max_tokens=80, **GREEDY)]
    kw = dict(model=looping_model, dtype="float32", max_total_tokens=4096)
    plain = LLM(**kw).generate([prompt] * len(params), params)
    llm = LLM(**kw, **SPEC)
    spec = llm.generate([prompt] * len(params), params)
    for a, b in zip(spec, plain):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
    assert len(spec[0].logprobs) == len(spec[0].token_ids) == 60
    assert spec[0].logprobs == pytest.approx(plain[0].logprobs, abs=1e-4)
    for a, b in zip(spec[0].top_logprobs, plain[0].top_logprobs):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert [lp for _, lp in a] == pytest.approx([lp for _, lp in b], abs=1e-4)
    assert all(o.speculative["spec_drafted_tokens"] > 0 for o in spec), [o.speculative for o in spec]
    assert spec[0].speculative["spec_accepted_tokens"] > 0
    assert spec[5].speculative["spec_accepted_tokens"] > 0
    assert sum(o.speculative["spec_accepted_tokens"] for o in spec[1:5]) > 0
    # Overlap scheduling is off with speculative decoding (even where it would run).
    cfg = EngineConfig(model=looping_model, **SPEC)
    assert not overlap_enabled(cfg, "cuda", 1)
    assert overlap_enabled(EngineConfig(model=looping_model), "cuda", 1)


# -- sampling: exactly the target's distribution ------------------------------------------

class ScriptedProposer(Proposer):
    """Drafts from a table of the target's top-2 tokens per context: the likelier token
    in some contexts and the other in the rest, so drafts are often kept and often
    rejected. Deterministic given the context, as n-gram drafts are."""

    def __init__(self, prompt: list[int], tops: dict[tuple, dict[int, float]]) -> None:
        self.prompt, self.tops = prompt, tops

    def propose(self, req, max_len: int) -> list[int]:
        out = tuple(req.token_ids[len(self.prompt):])
        draft: list[int] = []
        while len(draft) < max_len and out + tuple(draft) in self.tops:
            ranked = sorted(self.tops[out + tuple(draft)].items(), key=lambda kv: -kv[1])
            draft.append(ranked[sum(out + tuple(draft)) % 2][0])
        return draft


def assert_outputs_follow(llm, prompt: list[int], params: SamplingParams, n: int,
                          expected: dict[tuple, float]) -> None:
    """n outputs of `prompt` are distributed as `expected` (16 outcomes; chi-square)."""
    counts: dict[tuple, int] = {}
    for o in llm.generate([prompt] * n, params):
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    assert set(counts) <= set(expected)
    assert _chi2(counts, expected, n) < CHI2_999[15], (counts, expected)


def test_sampled_outputs_follow_the_target_distribution(looping_model):
    """Four sampled tokens (top-2: 16 outcomes) with drafts of up to two tokens after the
    first: the joint distribution of the outputs matches the target's, computed exactly
    with HF (chi-square)."""
    prompt = copy_prompts(1, seed=0)[0]
    top_k, temperature, max_tokens, n = 2, 2.0, 4, 800
    tops, expected = hf_top_k_tree(looping_model, prompt, top_k, temperature, max_tokens)
    llm = LLM(model=looping_model, dtype="float32", max_total_tokens=16384, seed=1, **SPEC)
    llm.engine.speculator.proposer = ScriptedProposer(prompt, tops)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                            ignore_eos=True)
    assert_outputs_follow(llm, prompt, params, n, expected)
    s = spec_stats(llm)
    assert 0.2 < s["spec_acceptance_rate"] < 0.9, s
    assert s["spec_drafted_tokens"] > n  # drafts of two tokens, verified at once


# -- random traffic ---------------------------------------------------------------------------

def traffic_batch():
    """Random traffic's requests: overlap's mixed batch and copy prompts, in a random
    arrival order; and the random source that goes on to drive it."""
    prompts, params = mixed_batch(seed=5, with_sync_requests=True)
    prompts += copy_prompts(6, seed=8)
    params += [SamplingParams(max_tokens=50, **GREEDY) for _ in range(6)]
    r = random.Random(6)
    order = list(range(len(prompts)))
    r.shuffle(order)
    return prompts, params, order, r


def test_random_arrivals_aborts_and_preemption_leak_nothing(looping_model):
    """Requests (greedy, seeded-sampled structured, logprobs, stop strings) arrive and
    are aborted at random steps in a pool small enough to retract: finished greedy requests
    equal plain decoding alone, aborted ones are prefixes of it, no KV slot leaks. (Seeded
    sampled requests that speculate draw their randomness differently from plain decoding,
    and whether a draft gets KV depends on the pool: they must only finish.)"""
    prompts, params, order, r = traffic_batch()
    alone = LLM(model=looping_model, dtype="float32", max_total_tokens=8192).generate(prompts, params)
    eng = Engine(EngineConfig(model=looping_model, dtype="float32", max_total_tokens=200,
                              chunked_prefill_size=32, max_running_requests=8, **SPEC))
    stats = drive_random_traffic(eng, prompts, params, alone, order, r,
                                 exact=lambda i: params[i].is_greedy)
    assert stats["preemptions"] > 0 and stats["spec_accepted_tokens"] > 0
    held = eng.cache.all_slots() + eng.runner.kv_pool.allocator.free_slots()
    assert len(set(held)) == len(held) == stats["total_slots"]  # no slot freed twice


def test_drafts_only_for_steps_a_graph_covers(looping_model):
    """On a GPU a verify step that fits no extend graph runs eagerly (several plain steps'
    cost): with the target's graph limits at 2 requests / 8 tokens, steps with 3 requests
    running draft nothing, and drafted steps stay within 8 tokens; outputs stay plain's."""
    prompts = copy_prompts(3, seed=2)
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (12, 40, 40)]
    plain = LLM(model=looping_model, dtype="float32").generate(prompts, params)
    llm = LLM(model=looping_model, dtype="float32", **SPEC)
    llm.engine.speculator.graph_limits = (2, 8)  # what a GPU's extend graphs would set
    steps = []  # (requests, tokens, drafted) of every step
    forward = llm.engine.runner.forward

    def recording(plan, *args, **kwargs):
        steps.append((len(plan.chunks), plan.num_tokens, any(c.draft for c in plan.chunks)))
        return forward(plan, *args, **kwargs)

    llm.engine.runner.forward = recording
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    drafted = [(n, t) for n, t, d in steps if d]
    assert drafted and all(n <= 2 and t <= 8 for n, t in drafted), steps
    assert not any(d for n, _, d in steps if n == 3), steps
    assert any(n == 3 for n, _, _ in steps)  # (three did run together, undrafted)


@pytest.mark.parametrize("drafts", [["--draft-tokens", "2", "--max-tokens", "48"],
                                    ["--draft-model", "same", "--num-steps", "2", "--max-tokens", "24"]],
                         ids=["ngram", "draft-model"])
def test_benchmark_smoke_on_the_demo_model(tmp_path, monkeypatch, capsys, drafts):
    """scripts/bench_speculative.py at toy sizes, n-gram drafts and a draft model (the target
    itself, so every draft is kept): fewer target forwards than plain decoding, the same
    output, and the table and JSON written."""
    from bench_scripts import run_script_here

    plain, spec = run_script_here("bench_speculative.py", "--device", "cpu", *drafts,
                                  json_path=tmp_path / "spec.json", monkeypatch=monkeypatch)
    assert plain["draft_tokens"] == 0 and plain["forwards_per_token"] == 1.0
    assert spec["draft_tokens"] == 2 and spec["forwards_per_token"] < 1.0 < spec["mean_acceptance_length"]
    if "same" in drafts:
        assert spec["acceptance_rate"] == 1.0 and spec["draft_forwards_per_token"] > 0
    table = capsys.readouterr().out.splitlines()
    rows = table[table.index(next(line for line in table if "same output" in line)) + 1:]
    assert [line.split()[-1] for line in rows] == ["True", "True"]
