"""The overlap scheduler's bookkeeping on CPU: tokens in flight, requests finishing in flight,
structured output (masks after the previous step's tokens, jump-forward in between) and
aborts. The engine turns overlap on for CUDA only; these tests attach the stepper to a CPU
engine, where it overlaps nothing but runs the same code. Outputs must equal sync stepping."""
from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest

from engine import LLM, AsyncEngine, EngineConfig, SamplingParams
from engine.runtime.overlap import OverlapStepper


def overlapped(llm_or_engine):
    """Step the engine with the overlap stepper; returns a list that grows by one per step
    it runs in sync."""
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    sync = engine.stepper
    sync_steps = []
    step_sync = sync.step

    def counted():
        sync_steps.append(1)
        return step_sync()

    sync.step = counted
    engine.stepper = OverlapStepper(sync, engine.config.max_running_requests)
    return sync_steps


def assert_no_leak(stats):
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["free_slots"] + stats["evictable_slots"] == stats["total_slots"]


def assert_same_work(llm, reference):
    """No request was retracted to recover a lost token, and no step was wasted (a step
    launched for requests that finished meanwhile is at most one more)."""
    a, b = llm.stats(), reference.stats()
    assert_no_leak(a)
    assert a["preemptions"] == b["preemptions"] == 0
    assert b["steps"] <= a["steps"] <= b["steps"] + 1, (a["steps"], b["steps"])


def mixed_batch(seed: int, with_sync_requests: bool = False):
    """Unconstrained requests of many lengths and stop tokens, JSON schemas and regexes,
    greedy and seeded sampling; optionally a request that forces sync steps while present
    (logprobs) and one with a stop string."""
    from test_structured import REGEXES, SCHEMAS  # (jsonschema: not on the GPU machine)

    r = random.Random(seed)
    prompts, params = [], []
    for i in range(12):
        prompts.append([r.randint(3, 700) for _ in range(r.randint(3, 60))])
        params.append(SamplingParams(max_tokens=1 + (i * 7) % 30, temperature=0.0, ignore_eos=True,
                                     stop_token_ids=[(i * 13) % 700]))
    for i, schema in enumerate(SCHEMAS[:8]):
        prompts.append("The old lighthouse" if i % 2 else "Numbers are everywhere")
        sampler = dict(temperature=0.0) if i % 2 else dict(temperature=1.0, seed=i)
        params.append(SamplingParams(max_tokens=120, json_schema=schema, **sampler))
    for i, regex in enumerate(REGEXES[:5]):
        prompts.append("She opened the letter")
        params.append(SamplingParams(max_tokens=60, regex=regex, temperature=0.0))
    if not with_sync_requests:
        return prompts, params
    prompts += ["In the market square", "Once upon a time"]
    params += [SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True, logprobs=True),
               SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=["e"])]
    return prompts, params


def overlapped_equals_sync(kw: dict, prompts, params):
    """Run the requests on a sync-stepped engine and an overlapped one (configs `kw`);
    assert equal tokens and finish reasons. Returns (overlapped LLM, reference LLM, their
    outputs, the overlapped run's sync steps)."""
    reference = LLM(**kw)
    sync = reference.generate(prompts, params)
    llm = LLM(**kw)
    sync_steps = overlapped(llm)
    over = llm.generate(prompts, params)
    for a, b in zip(over, sync):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
    return llm, reference, over, sync, sync_steps


def test_overlap_equals_sync_unconstrained(tiny_llama):
    """In-flight tokens read on the device, requests finishing while their next step runs."""
    prompts, params = mixed_batch(seed=3)
    prompts, params = prompts[:12], params[:12]
    kw = dict(model=tiny_llama, dtype="float32", max_total_tokens=600, chunked_prefill_size=48)
    llm, reference, _, _, sync_steps = overlapped_equals_sync(kw, prompts, params)
    assert not sync_steps
    assert_same_work(llm, reference)


@pytest.mark.parametrize("jump_forward", [True, False])
def test_overlap_equals_sync_with_structured_output(tiny_llama, jump_forward):
    prompts, params = mixed_batch(seed=1)
    kw = dict(model=tiny_llama, dtype="float32", max_total_tokens=8192, chunked_prefill_size=64,
              enable_jump_forward=jump_forward)
    reference = LLM(**kw)
    sync = reference.generate(prompts, params)
    llm = LLM(**kw)
    sync_steps = overlapped(llm)
    over = llm.generate(prompts, params)
    assert_same_work(llm, reference)
    if jump_forward:  # a jump would cost its request a step when overlapped: sync
        assert sync_steps
    else:
        assert not sync_steps, "constrained requests made the engine step in sync"
    for a, b in zip(over, sync):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.text == b.text
    from test_structured import REGEXES, SCHEMAS, check_json, check_regex

    n = 12 + 8
    assert check_json(llm, over[12:n], params[12:n], SCHEMAS[:8]) > 0
    check_regex(llm, over[n:n + 5], params[n:n + 5], REGEXES[:5])
    if jump_forward:
        assert llm.engine.num_jump_forward_tokens > 0


def test_overlap_under_memory_pressure(tiny_llama):
    """Retractions while tokens are in flight: outputs still equal sync stepping."""
    prompts, params = mixed_batch(seed=2)
    kw = dict(model=tiny_llama, dtype="float32", max_total_tokens=200, chunked_prefill_size=32)
    sync = LLM(**kw).generate(prompts, params)
    llm = LLM(**kw)
    overlapped(llm)
    over = llm.generate(prompts, params)
    assert [o.token_ids for o in over] == [o.token_ids for o in sync]
    assert llm.stats()["preemptions"] > 0
    assert_no_leak(llm.stats())


def test_logprobs_stay_overlapped_and_equal_sync(tiny_llama):
    """Logprobs, top logprobs and prompt logprobs are copied back with the tokens: no sync
    steps, and the same values as sync stepping (with penalties, grammars and plain requests
    beside)."""
    prompts, params = mixed_batch(seed=4, with_sync_requests=True)
    more, more_params = penalized_batch(seed=6)
    prompts, params = prompts + more[:6], params + more_params[:6]
    for i in (0, 3, 14, 27):
        params[i] = replace(params[i], logprobs=True, top_logprobs=i % 4 + 1)
    for i, start in ((1, 0), (4, 5), (11, 0), (28, 2)):  # prompt logprobs: chunks of 40
        params[i] = replace(params[i], prompt_logprobs_start=start, top_logprobs=i % 3)
    prompts[11] = prompts[11] * 4  # chunks that sample nothing
    assert len(prompts[11]) > 80
    kw = dict(model=tiny_llama, dtype="float32", max_total_tokens=8192, chunked_prefill_size=40,
              enable_jump_forward=False)
    _, _, over, sync, sync_steps = overlapped_equals_sync(kw, prompts, params)
    assert not sync_steps
    for a, b, p in zip(over, sync, params):  # (steps batch rows differently: float noise)
        assert (a.logprobs is None) == (b.logprobs is None)
        if a.logprobs is not None:
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        for x, y in zip(a.top_logprobs or [], b.top_logprobs or []):
            assert [t for t, _ in x] == [t for t, _ in y]
            assert [v for _, v in x] == pytest.approx([v for _, v in y], abs=1e-4)
        if p.logprobs:
            assert len(a.logprobs) == len(a.token_ids)
        if p.top_logprobs and p.logprobs:
            assert [len(t) for t in a.top_logprobs] == [p.top_logprobs] * len(a.token_ids)
        if p.prompt_logprobs_start is not None:
            assert a.prompt_logprobs[p.prompt_logprobs_start + 1:] == pytest.approx(
                b.prompt_logprobs[p.prompt_logprobs_start + 1:], abs=1e-4)
            assert len(a.prompt_logprobs) == len(a.prompt_token_ids)
            for x, y in zip(a.prompt_top_logprobs or [], b.prompt_top_logprobs or []):
                assert (x is None) == (y is None) and [t for t, _ in x or []] == [t for t, _ in y or []]


def abort_mid_stream(eng: AsyncEngine, prompt, params: SamplingParams, after: int = 5):
    """Stream a request, abort it after `after` deltas; returns (deltas, engine stats)."""
    async def main():
        got = []
        async for d in eng.generate(prompt, params, request_id="x"):
            got.append(d)
            if len(got) == after:
                await eng.abort("x")
        return got, await eng.stats()

    try:
        return asyncio.run(main())
    finally:
        eng.shutdown()


def test_overlap_abort_of_a_constrained_request_mid_flight(tiny_llama):
    eng = AsyncEngine(EngineConfig(model=tiny_llama, dtype="float32", max_total_tokens=2048,
                                   enable_jump_forward=False))
    sync_steps = overlapped(eng.engine)
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 200}
    params = SamplingParams(max_tokens=400, json_schema=schema, temperature=0.0)
    got, stats = abort_mid_stream(eng, "Numbers are everywhere", params)
    assert not sync_steps
    assert got[-1].finish_reason == "abort"
    assert all(t >= 0 for d in got for t in d.token_ids)
    assert_no_leak(stats)


@pytest.mark.parametrize("overlap,jump_forward", [(True, False), (True, True), (False, True)])
def test_random_arrivals_aborts_and_preemption(tiny_llama, overlap, jump_forward):
    """Requests arrive and are aborted at random steps in a pool small enough to retract:
    every request that finishes has exactly the output it has alone in a roomy engine, an
    aborted one a prefix of it, and no KV slot leaks."""
    from engine.runtime.engine import Engine

    prompts, params = mixed_batch(seed=5, with_sync_requests=True)
    r = random.Random(6)
    order = list(range(len(prompts)))
    r.shuffle(order)
    alone = LLM(model=tiny_llama, dtype="float32", max_total_tokens=8192,
                enable_jump_forward=jump_forward).generate(prompts, params)

    eng = Engine(EngineConfig(model=tiny_llama, dtype="float32", max_total_tokens=180,
                              chunked_prefill_size=32, max_running_requests=8,
                              enable_jump_forward=jump_forward))
    if overlap:
        overlapped(eng)
    stats = drive_random_traffic(eng, prompts, params, alone, order, r)
    assert stats["preemptions"] > 0


def drive_random_traffic(eng, prompts, params, alone, order, r: random.Random,
                         exact=lambda i: True) -> dict:
    """Add requests at random steps and abort a quarter of them a random number of steps
    later; then check: no KV leak, finished outputs equal `alone`, aborted ones are
    prefixes of it (for requests `exact(i)` holds for; the others must only finish).
    Returns the engine's stats."""
    arrive = {i: r.randint(0, 40) for i in order}
    abort_at = {i: arrive[i] + r.randint(1, 30) for i in order if r.random() < 0.25}
    reqs, step = {}, 0
    while len(reqs) < len(order) or eng.has_work:
        for i in order:
            if arrive[i] == step:
                reqs[i] = eng.add_request(f"r{i}", prompts[i], params[i])
            if abort_at.get(i) == step and i in reqs:
                eng.abort(f"r{i}")
        eng.step()
        step += 1
        assert step < 5000, "the engine stopped making progress"
    stats = eng.stats()
    assert_no_leak(stats)
    finished = 0
    for i, req in reqs.items():
        out = eng.output_of(req)
        expected = alone[i].token_ids
        if not exact(i):
            assert req.finish_reason in ("stop", "length", "abort"), i
        elif req.finish_reason == "abort":
            assert expected[:len(out.token_ids)] == out.token_ids, i
        else:
            finished += 1
            assert (out.token_ids, out.finish_reason) == (expected, alone[i].finish_reason), i
    assert finished >= len(order) // 2
    return stats


def penalized_batch(seed: int):
    """Repetition, frequency and presence penalties, logit_bias and min_tokens (the tiny
    model repeats itself, so the penalties change its outputs), greedy and seeded."""
    r = random.Random(seed)
    prompts, params = [], []
    for i in range(14):
        prompts.append([r.randint(3, 700) for _ in range(r.randint(3, 50))])
        kw = [dict(repetition_penalty=3.0), dict(frequency_penalty=2.0),
              dict(presence_penalty=2.0), dict(logit_bias={5: 40.0, 9: -3.0}),
              dict(min_tokens=6, stop_token_ids=[r.randint(3, 700)]),
              dict(repetition_penalty=0.5, frequency_penalty=1.0), dict()][i % 7]
        sampling = dict(temperature=0.0) if i % 3 else dict(temperature=0.9, seed=i)
        params.append(SamplingParams(max_tokens=4 + (i * 5) % 24, ignore_eos=i % 2 == 0,
                                     **kw, **sampling))
    return prompts, params


@pytest.mark.parametrize("total_tokens", [4096, 160])
def test_penalties_stay_overlapped_and_equal_sync(tiny_llama, total_tokens):
    """Penalties read each request's tokens: counted on the device, the token in flight
    included, so overlapped steps need no host sync and give the sync stepper's outputs,
    with retractions too (160 slots)."""
    prompts, params = penalized_batch(seed=5)
    kw = dict(model=tiny_llama, dtype="float32", max_total_tokens=total_tokens,
              chunked_prefill_size=32)
    llm, _, _, sync, sync_steps = overlapped_equals_sync(kw, prompts, params)
    assert not sync_steps
    plain = LLM(**kw).generate(prompts, [SamplingParams(max_tokens=p.max_tokens,
                                                        temperature=p.temperature, seed=p.seed,
                                                        ignore_eos=p.ignore_eos) for p in params])
    assert sum(a.token_ids != b.token_ids for a, b in zip(sync, plain)) >= 6  # penalties bite
    assert_no_leak(llm.stats())
    if total_tokens < 1000:
        assert llm.stats()["preemptions"] > 0
    stats = llm.engine.sampler.stats
    assert not stats.slot and sorted(stats.free) == list(range(1, stats.table.shape[0]))
    assert not stats.table[stats.ZERO].any()  # logit_bias / min_tokens rows: zeros, shared
