"""The engine end to end on CPU: equality with HF transformers, the radix cache, chunked
prefill, preemption, stops, and bad input."""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from hf_reference import hf_greedy

GREEDY = dict(temperature=0.0, ignore_eos=True)


def random_prompts(n: int, lo: int, hi: int, seed: int = 0, vocab: int = 400) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randint(3, vocab) for _ in range(r.randint(lo, hi))] for _ in range(n)]


def assert_matches_hf(path: str, outs, max_tokens: int) -> None:
    for o in outs:
        assert o.token_ids == hf_greedy(path, o.prompt_token_ids, max_tokens), o.request_id


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "llama3"])
def test_greedy_matches_hf_mixed_lengths(tiny_model_factory, arch):
    path = tiny_model_factory(arch)
    llm = LLM(model=path, dtype="float32", max_total_tokens=4096)
    prompts = random_prompts(5, 3, 40, seed=1)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, **GREEDY))
    assert [o.prompt_token_ids for o in outs] == prompts
    assert all(o.finish_reason == "length" and len(o.token_ids) == 12 for o in outs)
    assert_matches_hf(path, outs, 12)


def test_text_prompts_and_order(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", max_total_tokens=2048)
    prompts = ["The cat sat on the mat", "Hello", "A much longer prompt about many things"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, **GREEDY))
    for prompt, o in zip(prompts, outs):
        assert o.prompt_token_ids == llm.tokenizer.encode(prompt)
        full = llm.tokenizer.decode(o.token_ids)
        # Equal, except that bytes of a character cut off at the end are never emitted.
        assert full.startswith(o.text) and set(full[len(o.text):]) <= {"\ufffd"}


def test_chunked_prefill_matches_hf(tiny_qwen3):
    llm = LLM(model=tiny_qwen3, dtype="float32", max_total_tokens=4096, chunked_prefill_size=7)
    prompts = random_prompts(4, 20, 60, seed=2)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, **GREEDY))
    assert_matches_hf(tiny_qwen3, outs, 10)


def test_tiny_pool_preempts_and_evicts_but_matches_hf(tiny_llama):
    # 8 requests of up to 40 + 24 tokens cannot all fit in 160 slots at once.
    llm = LLM(model=tiny_llama, dtype="float32", max_total_tokens=160, chunked_prefill_size=16)
    prompts = random_prompts(8, 20, 40, seed=3)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, **GREEDY))
    stats = llm.stats()
    assert stats["preemptions"] > 0
    assert_matches_hf(tiny_llama, outs, 24)
    assert stats["free_slots"] + stats["evictable_slots"] == stats["total_slots"]
    # Re-running shared prefixes forces eviction of older ones in so small a pool.
    outs2 = llm.generate(random_prompts(8, 20, 40, seed=4), SamplingParams(max_tokens=4, **GREEDY))
    assert_matches_hf(tiny_llama, outs2, 4)


def test_cache_on_off_identical_and_cached_tokens(tiny_llama):
    base = random_prompts(1, 30, 30, seed=5)[0]
    prompts = [base + [7, 8, 9], base + [10, 11], base[:20] + [12] * 5, base + [7, 8, 9]]
    params = SamplingParams(max_tokens=8, **GREEDY)
    on = LLM(model=tiny_llama, dtype="float32", max_total_tokens=2048)
    off = LLM(model=tiny_llama, dtype="float32", max_total_tokens=2048, enable_radix_cache=False)
    first = on.generate([prompts[0]], params)[0]
    assert first.cached_tokens == 0
    rest = on.generate(prompts[1:], params)
    # Prefix of 30 from the first; 20 tokens; the whole prompt except its last token.
    assert [o.cached_tokens for o in rest] == [30, 20, len(prompts[3]) - 1]
    ref = off.generate(prompts, params)
    assert [o.token_ids for o in [first] + rest] == [o.token_ids for o in ref]
    assert all(o.cached_tokens == 0 for o in ref)
    assert on.stats()["cached_tokens"] == 30 + 20 + len(prompts[3]) - 1
    assert off.stats()["cache_hit_rate"] == 0.0


def test_requests_arriving_later_share_a_prefill_in_flight(tiny_llama):
    """A prompt's KV enters the tree after its prefill, so a same-prefix request admitted
    while the first still decodes hits it."""
    from engine.engine import Engine
    from engine.config import EngineConfig

    eng = Engine(EngineConfig(model=tiny_llama, dtype="float32", max_total_tokens=1024))
    prefix = random_prompts(1, 40, 40, seed=6)[0]
    eng.add_request("a", prefix + [1, 2], SamplingParams(max_tokens=20, **GREEDY))
    eng.step()
    b = eng.add_request("b", prefix + [3], SamplingParams(max_tokens=4, **GREEDY))
    while eng.has_work:
        eng.step()
    assert b.cached_tokens == 40


def test_stop_strings_and_stop_token_ids(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", max_total_tokens=2048)
    prompt = "The quick brown fox"
    free = llm.generate([prompt], SamplingParams(max_tokens=30, **GREEDY))[0]
    assert len(free.text) > 6
    stop = free.text[3:6]
    cut = llm.generate([prompt], SamplingParams(max_tokens=30, stop=[stop], **GREEDY))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[:free.text.index(stop)]
    tok = free.token_ids[5]
    by_id = llm.generate([prompt], SamplingParams(max_tokens=30, stop_token_ids=[tok], **GREEDY))[0]
    assert by_id.finish_reason == "stop"
    assert by_id.token_ids == free.token_ids[:free.token_ids.index(tok) + 1]


def test_eos_stops_unless_ignored(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", max_total_tokens=2048)
    eos = sorted(llm.engine.tokenizer.eos_token_ids)[0]
    free = llm.generate(["Once upon"], SamplingParams(max_tokens=6, **GREEDY))[0]
    # Treat the 3rd generated token as EOS by naming it a stop token id: same mechanism,
    # and check real EOS handling through the tokenizer's ids.
    assert eos in llm.engine.tokenizer.eos_token_ids
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=False)
    out = llm.generate(["Once upon"], params)[0]
    if eos in free.token_ids:
        assert out.token_ids == free.token_ids[:free.token_ids.index(eos) + 1]
        assert out.finish_reason == "stop"
    else:
        assert out.token_ids == free.token_ids


@pytest.mark.parametrize("bad, match", [
    (dict(prompt=[]), "empty"),
    (dict(prompt=[10**6]), "outside the vocabulary"),
    (dict(prompt=[-1]), "outside the vocabulary"),
    (dict(max_tokens=10**6), "context length"),
])
def test_bad_requests_raise_before_allocating(tiny_llama, bad, match):
    llm = LLM(model=tiny_llama, dtype="float32", max_total_tokens=1024)
    before = llm.stats()
    with pytest.raises(ValueError, match=match):
        llm.generate([bad.get("prompt", [5, 6])], SamplingParams(max_tokens=bad.get("max_tokens", 4)))
    assert llm.stats() == before


def test_prompt_larger_than_pool_is_rejected(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", max_total_tokens=32)
    with pytest.raises(ValueError, match="KV pool"):
        llm.generate([[5] * 30], SamplingParams(max_tokens=8))


@pytest.mark.parametrize("kwargs", [
    dict(max_tokens=0), dict(max_tokens=-3), dict(temperature=-1), dict(top_p=0),
    dict(top_p=1.5), dict(top_k=-5), dict(min_p=2.0), dict(repetition_penalty=0),
    dict(frequency_penalty=5), dict(presence_penalty=-3), dict(seed=-1), dict(top_logprobs=100),
    dict(stop=[""]), dict(regex="a", ebnf="b"), dict(json_schema="{not json"),
])
def test_sampling_params_validation(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_batch_validation_is_all_or_nothing(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", max_total_tokens=1024)
    with pytest.raises(ValueError):
        llm.generate([[5, 6, 7], []], SamplingParams(max_tokens=4))
    assert llm.stats()["waiting"] == 0 and llm.stats()["running"] == 0


def test_same_step_arrivals_with_a_long_shared_prefix_compute_it_once(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", max_total_tokens=4096)
    shared = random_prompts(1, 100, 100, seed=7)[0]
    prompts = [shared + [i + 3] * 4 for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, **GREEDY))
    assert [o.cached_tokens for o in outs] == [0, 100, 100, 100]
    assert_matches_hf(tiny_llama, outs, 4)


def test_random_adds_steps_and_aborts_never_leak(tiny_llama):
    from engine.config import EngineConfig
    from engine.engine import Engine

    eng = Engine(EngineConfig(model=tiny_llama, dtype="float32", max_total_tokens=200,
                              chunked_prefill_size=24, max_running_requests=6))
    r = random.Random(11)
    live: list[str] = []
    for i in range(150):
        action = r.random()
        if action < 0.3:
            prompt = [r.randint(3, 60) for _ in range(r.randint(1, 50))]
            eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=r.randint(1, 40), **GREEDY))
            live.append(f"r{i}")
        elif action < 0.4 and live:
            eng.abort(live.pop(r.randrange(len(live))))
        else:
            eng.step()
        in_tree = eng.cache.all_slots()
        owned = [s for q in eng.scheduler.running for s in q.slots[q.locked_len:]]
        free = eng.cache.allocator._free
        everything = in_tree + owned + free
        assert sorted(everything) == list(range(1, 201)), "a slot leaked or is held twice"
    while eng.has_work:
        eng.step()
    stats = eng.stats()
    assert stats["free_slots"] + stats["evictable_slots"] == stats["total_slots"]
