"""Speculative decoding with a draft model on CPU: with the target as its own draft every
draft is kept (the draft's KV catch-up and rollback are right); with a different tiny
draft, greedy outputs equal plain decoding on several architectures and through chunked
prefill, stops, max_tokens, shared prefixes and preemption; sampled outputs follow the
target's distribution (chi-square); random traffic with aborts leaks nothing in either
KV pool; a bad draft is a clear start-up error."""
from __future__ import annotations

import collections
import random
import re

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.runtime.engine import Engine, overlap_enabled
from hf_reference import hf_top_k_tree
from test_overlap import assert_no_leak, drive_random_traffic
from test_speculative import GREEDY, assert_outputs_follow, copy_prompts, traffic_batch

TARGET_STD, DRAFT_STD = 0.02, 0.03  # same seed, other scale: drafts agree part of the time


def draft_kw(draft: str, steps: int = 4) -> dict:
    return dict(speculative_algorithm="draft_model", speculative_draft_model=draft,
                speculative_num_steps=steps, speculative_num_draft_tokens=steps)


@pytest.fixture(scope="module")
def target(tiny_model_factory) -> str:
    return tiny_model_factory("llama", init_std=TARGET_STD)


@pytest.fixture(scope="module")
def draft(tiny_model_factory) -> str:
    return tiny_model_factory("llama", init_std=DRAFT_STD)


def assert_draft_pool_full(stats: dict) -> None:
    """Every draft KV slot is free or in the draft's radix tree, unlocked."""
    assert (stats["spec_draft_free_slots"] + stats["spec_draft_evictable_slots"]
            == stats["spec_draft_total_slots"]), stats


def assert_no_slot_twice(eng: Engine) -> None:
    """Target and draft pools: every slot is free or in the tree, none of them twice."""
    draft = eng.speculator.proposer
    for cache, allocator in ((eng.cache, eng.runner.kv_pool.allocator),
                             (draft.kv.cache, draft.runner.kv_pool.allocator)):
        held = cache.all_slots() + allocator.free_slots()
        assert len(set(held)) == len(held) == allocator.num_slots


# -- the target as its own draft --------------------------------------------------------------

def test_target_as_draft_keeps_every_draft(target):
    """Same weights, same KV: the draft's argmax is the target's, so every draft is kept.
    A draft KV left stale after a step (catch-up or rollback wrong) shows up as rejections."""
    prompts = copy_prompts(5, seed=1)
    params = SamplingParams(max_tokens=45, **GREEDY)
    kw = dict(model=target, dtype="float32", max_total_tokens=4096)
    plain = LLM(**kw).generate(prompts, params)
    llm = LLM(**kw, **draft_kw(target))
    spec = llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    s = llm.stats()
    assert s["spec_drafted_tokens"] > 100 and s["spec_accepted_tokens"] == s["spec_drafted_tokens"]
    assert s["spec_mean_acceptance_length"] > 4.5  # 4 drafts + 1 per step, less the tails
    assert s["steps"] < 15  # plain decoding: 1 + 44 steps
    # One catch-up forward and three decode forwards per step with drafts.
    assert s["spec_draft_forwards"] <= 4 * s["steps"]
    assert_no_leak(s)
    assert_draft_pool_full(s)


def test_draft_tokens_stay_on_the_device_between_forwards(target):
    """Unconstrained requests: every draft forward after a step's first takes the previous
    forward's tokens as in-flight inputs (no host read in between), and drafts stay exact
    (the target as its own draft keeps them all). A constrained request walks its grammar on
    the host, one read per forward."""
    from test_speculative_constrained import PROMPT

    llm = LLM(model=target, dtype="float32", max_total_tokens=4096, **draft_kw(target))
    runner, chained = llm.engine.speculator.proposer.runner, []
    forward = runner.forward
    runner.forward = lambda plan, pending=None: chained.append(pending is not None) or forward(plan, pending)
    llm.generate(copy_prompts(3, seed=2), SamplingParams(max_tokens=30, **GREEDY))
    s = llm.stats()
    assert s["spec_accepted_tokens"] == s["spec_drafted_tokens"] > 30
    assert chained.count(True) >= 2 * chained.count(False) > 0, chained  # 4 drafts: 1 + 3
    chained.clear()
    llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0.0, regex=r"(ab|cd| )+"))
    assert chained and not any(chained)


def test_draft_goes_on_right_after_rejections(tiny_llama):
    """The target as its own draft, but the third draft token of every step is replaced by
    a wrong one, from which the draft goes on: the target rejects it, and the draft must
    drop the KV it computed from there and catch up on the target's token. Then, step
    after step, exactly the two drafts before the wrong one are kept."""
    llm = LLM(model=tiny_llama, dtype="float32", max_total_tokens=4096, **draft_kw(tiny_llama))
    proposer = llm.engine.speculator.proposer
    forward_tokens, propose_batch = proposer._forward_tokens, proposer.propose_batch
    position, lengths = [0], []

    def corrupted_forward_tokens(chunks, reqs, pending=None):
        tokens = forward_tokens(chunks, reqs, pending)  # (on the device, fed to the next forward)
        position[0] += 1
        return (tokens + 1) % 700 if position[0] == 3 else tokens

    def counted_propose_batch(reqs, rooms):
        position[0] = 0
        drafts = propose_batch(reqs, rooms)
        lengths.extend(len(d) for d in drafts if d)
        return drafts

    proposer._forward_tokens, proposer.propose_batch = corrupted_forward_tokens, counted_propose_batch
    prompts = copy_prompts(4, seed=6)
    params = SamplingParams(max_tokens=40, **GREEDY)
    plain = LLM(model=tiny_llama, dtype="float32", max_total_tokens=4096).generate(prompts, params)
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
    s = llm.stats()
    assert s["spec_drafted_tokens"] == sum(lengths) and max(lengths) == 4
    assert s["spec_accepted_tokens"] == sum(min(n, 2) for n in lengths)
    assert s["spec_steps"] == len(lengths) > 4 * 40 / 3 - 8  # every step drafts (3 tokens)
    assert_draft_pool_full(s)


# -- a different draft: greedy is token for token plain decoding ------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_greedy_equals_plain_decoding(tiny_model_factory, arch):
    target = tiny_model_factory(arch, init_std=TARGET_STD)
    draft = tiny_model_factory(arch, init_std=DRAFT_STD)
    prompts = copy_prompts(4, seed=2)
    params = SamplingParams(max_tokens=40, **GREEDY)
    kw = dict(model=target, dtype="float32", max_total_tokens=4096)
    plain = LLM(**kw).generate(prompts, params)
    llm = LLM(**kw, **draft_kw(draft, steps=3))
    spec = llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    s = llm.stats()
    assert 0 < s["spec_acceptance_rate"] < 1, s  # kept and rejected drafts both happen
    assert_no_leak(s)
    assert_draft_pool_full(s)


def test_a_smaller_draft_of_another_seed(tiny_model_factory):
    """A draft of another size and seed (it rejects nearly everything): still exact."""
    target = tiny_model_factory("qwen3", init_std=TARGET_STD)
    draft = tiny_model_factory("qwen3", seed=1, init_std=TARGET_STD, hidden_size=32,
                               intermediate_size=64, num_hidden_layers=1)
    prompts = copy_prompts(3, seed=3)
    params = SamplingParams(max_tokens=30, **GREEDY)
    kw = dict(model=target, dtype="float32", max_total_tokens=2048)
    plain = LLM(**kw).generate(prompts, params)
    llm = LLM(**kw, **draft_kw(draft))
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
    assert llm.stats()["spec_drafted_tokens"] > 0
    assert_draft_pool_full(llm.stats())


def test_chunked_prefill_stops_shared_prefix_and_preemption(target, draft):
    """A pool small enough to retract, chunked prefill, stop strings and tokens, EOS on,
    varied max_tokens, prompts sharing a long prefix (radix hits in both models), and
    a request with logprobs (the target's logprobs per kept token) and one with a penalty
    (applied at each verified position), both speculating, in the same batches. The draft catches up on
    prompts in chunks no larger than the target's."""
    r = random.Random(4)
    shared = [r.randint(3, 700) for _ in range(70)]
    prompts = copy_prompts(8, seed=4) + [shared + [r.randint(3, 700) for _ in range(5)]
                                         for _ in range(4)]
    prompts += ["The old lighthouse stood", "Numbers are everywhere", "She opened the letter"]
    params = [SamplingParams(max_tokens=r.randint(1, 60), temperature=0.0,
                             ignore_eos=bool(i % 2), stop_token_ids=[r.randint(3, 700)])
              for i in range(12)]
    params += [SamplingParams(max_tokens=70, temperature=0.0, stop=["e"]),
               SamplingParams(max_tokens=70, temperature=0.0, logprobs=True, ignore_eos=True),
               SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.3)]
    kw = dict(model=target, dtype="float32", max_total_tokens=200, chunked_prefill_size=16)
    plain = LLM(**kw).generate(prompts, params)
    llm = LLM(**kw, **draft_kw(draft))
    runner, sizes = llm.engine.speculator.proposer.runner, []
    forward = runner.forward
    runner.forward = lambda plan, *rest: sizes.append((plan.num_tokens, len(plan.chunks))) or forward(plan, *rest)
    spec = llm.generate(prompts, params)
    for a, b in zip(spec, plain):
        assert (a.token_ids, a.finish_reason, a.text) == (b.token_ids, b.finish_reason, b.text)
    assert all(n <= 16 or n == chunks for n, chunks in sizes) and max(sizes)[0] == 16, sizes
    assert spec[-2].logprobs == pytest.approx(plain[-2].logprobs, abs=1e-4)
    assert len(spec[-2].logprobs) == len(spec[-2].token_ids)
    assert spec[-2].speculative["spec_steps"] > 0 and spec[-1].speculative["spec_steps"] > 0
    s = llm.stats()
    assert s["preemptions"] > 0 and s["spec_accepted_tokens"] > 0 and s["cached_tokens"] > 0
    assert s["spec_draft_cached_tokens"] > 0  # the draft reused the shared prefix too
    assert_no_leak(s)
    assert_draft_pool_full(s)


@pytest.mark.parametrize("jump_forward", [True, False])
def test_structured_output_greedy_equals_plain(target, draft, jump_forward):
    """Greedy constrained requests speculate with the draft model's drafts (drafted under
    their grammar, verified under masks; jump-forward text caught up by the draft) and equal
    plain constrained decoding. A sampled constrained request drafts too (its distribution:
    the next test)."""
    from test_speculative_constrained import CONSTRAINED, PROMPT

    params = [SamplingParams(max_tokens=60, temperature=0.0, **c) for c in CONSTRAINED]
    params.append(SamplingParams(max_tokens=30, temperature=1.0, seed=3, **CONSTRAINED[0]))
    kw = dict(model=target, dtype="float32", max_total_tokens=4096,
              enable_jump_forward=jump_forward)
    plain = LLM(**kw).generate([PROMPT] * len(params), params)
    llm = LLM(**kw, **draft_kw(draft))
    spec = llm.generate([PROMPT] * len(params), params)
    assert [o.token_ids for o in spec[:-1]] == [o.token_ids for o in plain[:-1]]
    assert sum(o.speculative["spec_accepted_tokens"] for o in spec[:-1]) > 0
    assert spec[-1].speculative["spec_drafted_tokens"] > 0
    assert re.fullmatch(CONSTRAINED[0]["regex"], spec[-1].text), spec[-1].text
    assert_no_leak(llm.stats())
    assert_draft_pool_full(llm.stats())


def test_target_at_tp2(target, draft):
    """A tensor-parallel target (worker processes, gloo): the draft runs on rank 0 only,
    and the verify step reaches every rank as any extend step does."""
    prompts = copy_prompts(3, seed=9)
    params = SamplingParams(max_tokens=30, **GREEDY)
    plain = LLM(model=target, dtype="float32", max_total_tokens=1024).generate(prompts, params)
    llm = LLM(model=target, dtype="float32", max_total_tokens=1024, tp_size=2, **draft_kw(draft))
    try:
        assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
        assert llm.stats()["spec_accepted_tokens"] > 0
    finally:
        llm.close()


# -- sampling: exactly the target's distribution ------------------------------------------

def test_sampled_outputs_follow_the_target_distribution(target, draft):
    """Four sampled tokens (top-2 at temperature 2: 16 outcomes), drafted by a model whose
    distribution differs from the target's: the joint distribution of the outputs matches
    the target's, computed exactly with HF (chi-square). A q that is not the distribution
    the drafts were drawn from (e.g. at temperature 1) fails it by far."""
    prompt = copy_prompts(1, seed=0)[0]
    top_k, temperature, max_tokens, n = 2, 2.0, 4, 600
    _, expected = hf_top_k_tree(target, prompt, top_k, temperature, max_tokens)
    llm = LLM(model=target, dtype="float32", max_total_tokens=16384, seed=1, **draft_kw(draft))
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                            ignore_eos=True)
    assert_outputs_follow(llm, prompt, params, n, expected)
    s = llm.stats()
    # Without q (as if drafts were deterministic) verification is exact too, but keeps
    # about half as many drafts here (0.14 against 0.28).
    assert 0.2 < s["spec_acceptance_rate"] < 0.95, s
    assert s["spec_drafted_tokens"] > n
    assert_draft_pool_full(s)


def test_sampled_constrained_outputs_follow_plain_constrained_sampling(target, tiny_model_factory):
    """(ab|cd|ef){3} at temperature 1.5, 600 requests each way, drafted by a model of another
    seed (it keeps ~80% of drafts): the draft model drafts under the grammar (its q masked as
    the target's p is), and the outputs follow plain masked sampling (two-sample chi-square
    over the 27 outcomes: 13.6 against a 0.999 quantile of 54). Reporting the unmasked q for
    masked drafts gives 172; drafting unmasked and cutting afterwards leaves almost nothing
    drafted."""
    from test_speculative_constrained import PROMPT, chi2_quantile_999, chi2_two_sample

    draft = tiny_model_factory("llama", init_std=0.3, seed=5)
    n, regex = 600, r"(ab|cd|ef){3}"
    params = [SamplingParams(max_tokens=12, regex=regex, temperature=1.5, seed=i) for i in range(n)]
    kw = dict(model=target, dtype="float32", max_total_tokens=16384)
    plain = collections.Counter(o.text for o in LLM(**kw).generate([PROMPT] * n, params))
    llm = LLM(**kw, **draft_kw(draft, steps=3))
    spec = collections.Counter(o.text for o in llm.generate([PROMPT] * n, params))
    assert all(re.fullmatch(regex, text) for text in spec)
    stat, df = chi2_two_sample(spec, plain)
    assert df == 26 and stat < chi2_quantile_999(df), (stat, spec, plain)
    s = llm.stats()
    assert s["spec_drafted_tokens"] > 2 * n and 0.5 < s["spec_acceptance_rate"] < 0.95, s
    assert_no_leak(s)
    assert_draft_pool_full(s)


# -- random traffic ---------------------------------------------------------------------------

def test_random_arrivals_aborts_and_preemption_leak_nothing(target, draft):
    """Requests (greedy, seeded-sampled structured, logprobs, stop strings) arrive and are
    aborted at random steps in a pool small enough to retract: finished greedy requests
    equal plain decoding alone, aborted ones are prefixes of it, and both KV pools are whole
    again at the end (no slot leaked or freed twice). Seeded sampled requests draft too and
    draw their randomness differently from plain decoding: they must only finish."""
    prompts, params, order, r = traffic_batch()
    alone = LLM(model=target, dtype="float32", max_total_tokens=8192).generate(prompts, params)
    eng = Engine(EngineConfig(model=target, dtype="float32", max_total_tokens=200,
                              chunked_prefill_size=32, max_running_requests=8, **draft_kw(draft)))
    stats = drive_random_traffic(eng, prompts, params, alone, order, r,
                                 exact=lambda i: params[i].is_greedy)
    assert stats["preemptions"] > 0 and stats["spec_accepted_tokens"] > 0
    assert stats["aborted_requests"] > 0
    assert_draft_pool_full(stats)
    assert_no_slot_twice(eng)
    assert not eng.speculator.proposer.kv.seqs  # no request's draft state outlives it


# -- start-up -------------------------------------------------------------------------------

def test_bad_draft_models_are_start_up_errors(tiny_model_factory, target, tmp_path):
    with pytest.raises(ValueError, match="speculative_draft_model"):
        EngineConfig(model=target, speculative_algorithm="draft_model")
    with pytest.raises(ValueError, match="speculative_draft_model=.*cannot be loaded"):
        LLM(model=target, dtype="float32", max_total_tokens=256,
            **draft_kw(str(tmp_path / "no-such-model")))
    other_vocab = tiny_model_factory("llama", vocab_size=800)
    with pytest.raises(ValueError, match="vocabulary of 800 tokens"):
        LLM(model=target, dtype="float32", max_total_tokens=256, **draft_kw(other_vocab))
    # Overlap scheduling stays off with a draft model; CUDA graphs are the target's only.
    cfg = EngineConfig(model=target, enable_cuda_graph=True, **draft_kw(target))
    assert not overlap_enabled(cfg, "cuda", 1)


def test_memory_reserve_for_the_draft(tiny_model_factory, target, monkeypatch):
    """What the target's pool sizing leaves to the draft on a GPU: the draft's weights (as
    loaded) once, and its KV per slot beside the target's, for as many slots."""
    from types import SimpleNamespace

    from engine.executor.model_runner import MemoryReserve, ModelRunner
    from engine.speculative.draft_model import draft_memory_reserve

    for arch in ("llama", "qwen3"):
        path = tiny_model_factory(arch, init_std=DRAFT_STD)
        eng = Engine(EngineConfig(model=target, dtype="float32", max_total_tokens=64,
                                  **draft_kw(path)))
        reserve = draft_memory_reserve(eng.config)
        runner = eng.speculator.proposer.runner
        pool = runner.kv_pool
        assert reserve.bytes_per_token == pool.k[0][0].numel() * 4 * 2 * len(pool.k)
        # (exact for Llama; Qwen3's per-head q/k norms and Qwen2's biases are left out)
        loaded = 4 * sum(p.numel() for p in runner.model.parameters())
        assert reserve.fixed_bytes == (loaded if arch == "llama" else pytest.approx(loaded, rel=0.01))
        assert pool.num_slots == 64  # as many slots as the target's
    gib = 2**30
    monkeypatch.setattr("torch.cuda.synchronize", lambda device: None)
    monkeypatch.setattr("torch.cuda.mem_get_info", lambda device: (60 * gib, 100 * gib))
    fake = SimpleNamespace(device=SimpleNamespace(type="cuda"), config=EngineConfig(model=target),
                           reserve=MemoryReserve(fixed_bytes=5 * gib, bytes_per_token=1024))
    # 0.85 * 100 GiB - 40 GiB used - 5 GiB of draft weights, over 3 KiB + 1 KiB per slot
    assert ModelRunner._slots_from_memory(fake, 3072) == int(40 * gib // 4096)
