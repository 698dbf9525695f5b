"""Sampling on the real engine against HF transformers: seeds, top-k=1, the distributions
of temperature / top-k / top-p / min-p (statistical, fixed seeds), penalties, logprobs."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from engine import LLM, SamplingParams
from hf_reference import hf_greedy, hf_next_logprobs

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


# -- distributions of one sampled token vs Hugging Face's warpers on HF's logits ----------
N_DRAWS = 1500


def first_token_counts(llm, prompt: list[int], seeded: bool = True, **params) -> Counter:
    """N_DRAWS draws of the token after `prompt`, one request each, seeded 0..N-1 (so the
    counts do not depend on which tests ran before on the shared engine), or unseeded:
    drawn from the engine's own generator, many rows per step."""
    outs = llm.generate([prompt] * N_DRAWS,
                        [SamplingParams(max_tokens=1, ignore_eos=True,
                                        seed=i if seeded else None, **params)
                         for i in range(N_DRAWS)])
    return Counter(o.token_ids[0] for o in outs)


def hf_probs(path: str, prompt: list[int], *warpers) -> torch.Tensor:
    """The next-token distribution HF `generate` samples from: its logits through its
    LogitsWarpers, in order."""
    scores = hf_next_logprobs(path, prompt).unsqueeze(0)
    for warper in warpers:
        scores = warper(torch.tensor([prompt]), scores)
    return torch.softmax(scores, dim=-1)[0]


def assert_draws_follow(counts: Counter, probs: torch.Tensor, n: int = N_DRAWS) -> None:
    """Nothing outside the support, and each likely token's count (the rest pooled)
    within 4.5 standard deviations of n * p: a fixed-seed run passes with a wide margin,
    while any of the mix-ups below moves some count by far more."""
    outside = {t: c for t, c in counts.items() if probs[t] == 0}
    assert not outside, f"drew tokens the reference excludes: {outside}"
    big = [t for t in range(len(probs)) if probs[t] >= 0.02]
    buckets = [([t], probs[t].item()) for t in big]
    rest = max(0.0, 1.0 - sum(p for _, p in buckets))  # (float rounding can dip below 0)
    buckets.append(([t for t in counts if t not in big], rest))
    for tokens, p in buckets:
        got = sum(counts[t] for t in tokens)
        sd = math.sqrt(n * p * (1 - p))
        assert abs(got - n * p) <= 4.5 * sd + 1, (tokens[:5], got, n * p)


DIST_PROMPT = [100, 101, 102]  # its top tokens have well-separated probabilities


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_reshapes_the_distribution(llm, tiny_llama, temperature):
    """0.5 sharpens (top token 0.33 instead of 0.12 at 1.0), 2.0 flattens (0.025): an
    ignored or inverted temperature fails."""
    counts = first_token_counts(llm, DIST_PROMPT, temperature=temperature)
    assert_draws_follow(counts, hf_probs(tiny_llama, DIST_PROMPT,
                                         TemperatureLogitsWarper(temperature)))


def test_unseeded_rows_draw_independently(tiny_llama):
    """Requests without a seed share the engine's generator (seeded by the engine config,
    fixed here): each row of a step still gets its own draw."""
    llm = LLM(model=tiny_llama, dtype="float32", max_total_tokens=4096, seed=1234)
    counts = first_token_counts(llm, DIST_PROMPT, seeded=False, temperature=0.5)
    assert_draws_follow(counts, hf_probs(tiny_llama, DIST_PROMPT, TemperatureLogitsWarper(0.5)))


def test_top_k_distribution(llm, tiny_llama):
    counts = first_token_counts(llm, DIST_PROMPT, temperature=1.0, top_k=3)
    probs = hf_probs(tiny_llama, DIST_PROMPT, TopKLogitsWarper(3))
    assert (probs > 0).sum() == 3
    assert_draws_follow(counts, probs)


def test_top_p_applies_after_temperature(llm, tiny_llama):
    """At 0.7 the three top tokens hold 0.50 and the first two 0.39, so top_p=0.45 keeps
    three; at temperature 1 (top-p before temperature, a plausible slip) it would keep nine."""
    counts = first_token_counts(llm, DIST_PROMPT, temperature=0.7, top_p=0.45)
    probs = hf_probs(tiny_llama, DIST_PROMPT, TemperatureLogitsWarper(0.7),
                     TopPLogitsWarper(0.45))
    assert (probs > 0).sum() == 3
    assert_draws_follow(counts, probs)


def test_min_p_applies_after_temperature(llm, tiny_llama):
    """At 0.5 the top token has 0.41 and the next 0.094, 0.066: min_p=0.2 keeps two (at
    temperature 1 it would keep dozens)."""
    prompt = PROMPTS[0]
    counts = first_token_counts(llm, prompt, temperature=0.5, min_p=0.2)
    probs = hf_probs(tiny_llama, prompt, TemperatureLogitsWarper(0.5), MinPLogitsWarper(0.2))
    assert (probs > 0).sum() == 2
    assert_draws_follow(counts, probs)


# -- penalties vs references on HF's logits --------------------------------------------------
def openai_penalty_greedy(path: str, prompt: list[int], n: int, presence: float = 0.0,
                          frequency: float = 0.0, count_prompt: bool = False) -> list[int]:
    """Greedy decoding on HF's logits minus OpenAI's penalties: frequency * count +
    presence * (count > 0), counted over the generated tokens (`count_prompt` counts the
    prompt too: the slip this reference exists to catch)."""
    out: list[int] = []
    for _ in range(n):
        scores = hf_next_logprobs(path, prompt + out)
        counts = Counter(out + (prompt if count_prompt else []))
        for tok, c in counts.items():
            scores[tok] -= frequency * c + presence * (c > 0)
        out.append(int(scores.argmax()))
    return out


@pytest.fixture(scope="module")
def penalty_prompts(tiny_llama) -> list[list[int]]:
    """Prompts that already hold tokens the model goes on to generate (each followed by
    its own greedy continuation), so counting the prompt too would change the output."""
    return [PROMPTS[2]] + [p + hf_greedy(tiny_llama, p, 10) for p in PROMPTS[:2]]


@pytest.mark.parametrize("kind, value", [("presence", 1.0), ("presence", -2.0),
                                         ("frequency", 0.7)])
def test_presence_and_frequency_penalties_match_reference(llm, tiny_llama, penalty_prompts,
                                                          kind, value):
    n = 16
    penalty = {kind: value}
    outs = llm.generate(penalty_prompts, SamplingParams(max_tokens=n, temperature=0.0,
                                                        ignore_eos=True,
                                                        **{f"{kind}_penalty": value}))
    refs = [openai_penalty_greedy(tiny_llama, p, n, **penalty) for p in penalty_prompts]
    assert [o.token_ids for o in outs] == refs
    # The references differ from no penalty, and from the penalty counting the prompt too:
    # either slip would fail the comparison above.
    assert refs != [openai_penalty_greedy(tiny_llama, p, n) for p in penalty_prompts]
    assert refs != [openai_penalty_greedy(tiny_llama, p, n, count_prompt=True, **penalty)
                    for p in penalty_prompts]


def hf_repetition_greedy(path: str, prompt: list[int], n: int, penalty: float) -> list[int]:
    """Greedy decoding on HF's raw logits through HF's RepetitionPenaltyLogitsProcessor
    (prompt and output tokens; positive logits divided, negative ones multiplied: raw
    logits, since the rule is not shift-invariant)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    process = RepetitionPenaltyLogitsProcessor(penalty)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[:, -1].float()
            ids.append(int(process(torch.tensor([ids]), logits).argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("penalty", [1.5, 0.6])
def test_repetition_penalty_matches_hf(llm, tiny_llama, penalty):
    n = 16
    outs = gen(llm, max_tokens=n, temperature=0.0, repetition_penalty=penalty)
    for prompt, out in zip(PROMPTS, outs):
        assert out == hf_repetition_greedy(tiny_llama, prompt, n, penalty), prompt
    assert outs != gen(llm, max_tokens=n, temperature=0.0), "the penalty changed nothing"


def test_only_counted_penalties_take_token_count_rows(llm):
    """Requests whose penalties read no token counts (logit_bias, min_tokens) share the
    all-zero row instead of a 4-byte-per-vocabulary-entry row each; a mixed batch of them and
    repetition-penalised ones gives each request what it gives alone."""
    bias = dict(max_tokens=8, temperature=0.0, logit_bias={7: 5.0})
    bans = dict(max_tokens=8, temperature=0.0, min_tokens=8, stop_token_ids=[9])
    rep = dict(max_tokens=8, temperature=0.0, repetition_penalty=1.8)
    kinds = [bias, bans, rep] * 4
    alone = [gen(llm, **kw)[0] for kw in (bias, bans, rep)]
    llm.engine.sampler.stats = None  # count the rows this batch takes
    outs = llm.generate([PROMPTS[0]] * len(kinds),
                        [SamplingParams(ignore_eos=True, **kw) for kw in kinds])
    assert [o.token_ids for o in outs] == [alone[i % 3] for i in range(len(kinds))]
    stats = llm.engine.sampler.stats
    assert stats.table.shape[0] == 9  # the zero row and 8: four repetition requests at most
    assert not stats.table[stats.ZERO].any() and not stats.slot


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
