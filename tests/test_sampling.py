"""Sampling on the real engine: seeds, top-k=1, penalties, logprobs against HF."""
from __future__ import annotations

import math

import pytest

from engine import LLM, SamplingParams
from hf_reference import hf_next_logprobs

PROMPTS = [[5, 17, 33, 60, 2, 9], [100, 101, 102], [44] * 12]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=tiny_llama, dtype="float32", max_total_tokens=4096)


def gen(llm, **kw):
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(ignore_eos=True, **kw))]


def test_same_seed_same_output_different_seed_differs(llm):
    a = gen(llm, max_tokens=16, temperature=1.0, seed=123)
    b = gen(llm, max_tokens=16, temperature=1.0, seed=123)
    c = gen(llm, max_tokens=16, temperature=1.0, seed=124)
    assert a == b
    assert a != c


def test_seeded_request_independent_of_batch_mates(llm):
    alone = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.9, seed=7,
                                                      ignore_eos=True))[0].token_ids
    mixed = llm.generate(PROMPTS, [SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True),
                                   SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True),
                                   SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)])
    assert mixed[0].token_ids == alone


def test_top_k_1_equals_greedy(llm):
    assert gen(llm, max_tokens=10, temperature=1.5, top_k=1) == gen(llm, max_tokens=10, temperature=0.0)


def test_tiny_top_p_and_high_min_p_equal_greedy(llm):
    greedy = gen(llm, max_tokens=10, temperature=0.0)
    assert gen(llm, max_tokens=10, temperature=1.0, top_p=1e-6, seed=1) == greedy
    assert gen(llm, max_tokens=10, temperature=1.0, min_p=1.0, seed=1) == greedy


def test_sampling_is_not_greedy_at_high_temperature(llm):
    assert gen(llm, max_tokens=10, temperature=2.0, seed=3) != gen(llm, max_tokens=10, temperature=0.0)


def test_presence_and_repetition_penalties_reduce_repeats(llm):
    def repeats(outs):
        return sum(len(o) - len(set(o)) for o in outs)

    base = repeats(gen(llm, max_tokens=30, temperature=0.0))
    assert base > 0, "the tiny model should repeat itself greedily"
    assert repeats(gen(llm, max_tokens=30, temperature=0.0, presence_penalty=2.0)) < base
    assert repeats(gen(llm, max_tokens=30, temperature=0.0, frequency_penalty=2.0)) < base
    assert repeats(gen(llm, max_tokens=30, temperature=0.0, repetition_penalty=5.0)) < base


def test_negative_presence_penalty_increases_repeats(llm):
    outs = gen(llm, max_tokens=20, temperature=0.0, presence_penalty=-2.0)
    base = gen(llm, max_tokens=20, temperature=0.0)
    assert sum(len(set(o)) for o in outs) <= sum(len(set(o)) for o in base)


def test_logprobs_match_hf(llm, tiny_llama):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                                logprobs=True, top_logprobs=4))
    for o in outs:
        assert len(o.logprobs) == 3 and len(o.top_logprobs) == 3
        for i, tok in enumerate(o.token_ids):
            ref = hf_next_logprobs(tiny_llama, o.prompt_token_ids + o.token_ids[:i])
            assert math.isclose(o.logprobs[i], ref[tok].item(), abs_tol=1e-4)
            top = o.top_logprobs[i]
            assert [t for t, _ in top] == ref.topk(4).indices.tolist()
            assert top[0][0] == tok  # greedy picks the most likely token


def test_prompt_logprobs_match_hf_even_after_a_cache_hit(llm, tiny_llama):
    prompt = [5, 17, 33, 60, 2, 9, 41, 77, 12, 3]
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))  # cache it
    for start in (1, 4):
        out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0,
                                                    prompt_logprobs_start=start))[0]
        assert out.prompt_logprobs[:start] == [None] * start
        for pos in range(start, len(prompt)):
            ref = hf_next_logprobs(tiny_llama, prompt[:pos])[prompt[pos]].item()
            assert math.isclose(out.prompt_logprobs[pos], ref, abs_tol=1e-4)
        assert out.cached_tokens == start - 1
