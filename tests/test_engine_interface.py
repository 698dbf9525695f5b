"""The interface between the serving layer and the engine: both transports against the
EngineClient Protocol (engine/runtime/engine_client.py; its behaviour, one contract suite
for both: tests/test_engine_client.py), and what crosses between processes: a step's
WireDeltas (engine/core/outputs.py) as one WireBatch, and an engine call's
SamplingParams, built and validated once by the ingress."""
from __future__ import annotations

import inspect
import pickle

from engine import AsyncEngine, EngineClient, ProcessAsyncEngine, SamplingParams, WireBatch, WireDelta


def test_both_transports_have_the_protocols_signatures():
    """Every member of the Protocol, with the same parameters (names, kinds, defaults,
    annotations) and return annotation, async where the Protocol's is."""
    members = {name: value for name, value in vars(EngineClient).items() if not name.startswith("_")}
    assert {"generate", "stream_to", "abort", "stats", "flush_cache", "add_step_listener",
            "capacity", "in_flight", "check_capacity", "is_alive", "shutdown"} <= set(members)
    for cls in (AsyncEngine, ProcessAsyncEngine):
        for name, member in members.items():
            impl = inspect.getattr_static(cls, name)
            if isinstance(member, property):
                assert isinstance(impl, property), (cls, name)
                assert inspect.signature(impl.fget) == inspect.signature(member.fget), (cls, name)
                continue
            assert inspect.signature(impl) == inspect.signature(member), (cls, name)
            if inspect.signature(member).return_annotation.startswith("AsyncIterator"):
                assert inspect.isasyncgenfunction(impl), (cls, name)
            else:
                assert inspect.iscoroutinefunction(impl) == inspect.iscoroutinefunction(member), (cls, name)


def test_wire_deltas_join_as_stream_deltas_do():
    first = WireDelta("r", [1], False, None, 1, {"prompt_tokens": 4, "queue_time": 0.5,
                                                  "logprobs": [-0.1], "prompt_logprobs": [None]})
    middle = WireDelta("r", [2], False, None, 2, {"logprobs": [-0.2]})
    last = WireDelta("r", [3], True, "stop", 3, {"prompt_tokens": 4, "cached_tokens": 2,
                                                  "logprobs": [-0.3]})
    joined = first.then(middle).then(last)
    assert joined[:5] == ("r", [1, 2, 3], True, "stop", 3)
    assert joined.extras == {"prompt_tokens": 4, "cached_tokens": 2, "queue_time": 0.5,
                             "logprobs": [-0.1, -0.2, -0.3], "prompt_logprobs": [None]}
    plain = WireDelta("r", [4], False, None, 4)
    assert plain.then(plain) == ("r", [4, 4], False, None, 4, None)
    assert plain.extra("prompt_tokens", 0) == 0 and last.extra("cached_tokens") == 2


def test_a_wire_batch_pickles_as_columns_and_loads_as_wire_deltas():
    batch = WireBatch([WireDelta(f"r{i}", [i, i + 1], i == 3, "stop" if i == 3 else None, i + 2,
                                 {"prompt_tokens": 9} if i in (0, 3) else None) for i in range(4)])
    loaded = pickle.loads(pickle.dumps(batch, protocol=5))
    assert type(loaded) is WireBatch and loaded == batch
    assert all(type(d) is WireDelta for d in loaded) and loaded[3].extra("prompt_tokens") == 9
    # no per-delta class reference or call: as small as the same rows as bare tuples
    tuples = pickle.dumps([tuple(d) for d in batch], protocol=5)
    assert len(pickle.dumps(batch, protocol=5)) <= len(tuples) + 80
    assert pickle.loads(pickle.dumps(WireBatch())) == []


def test_wire_delta_benchmark_runs(tmp_path, monkeypatch, capsys):
    """scripts/bench_wire_delta.py at toy sizes: every form round-trips under each pickler
    (it asserts so) and the table and JSON come out."""
    from bench_scripts import run_script_here

    result = run_script_here("bench_wire_delta.py", "--batch", "16", "--repeat", "20",
                             json_path=tmp_path / "wire.json", monkeypatch=monkeypatch)
    rows = {(r["pickler"], r["form"]): r for r in result}
    assert {form for _, form in rows} == {"tuple", "WireDelta list", "WireBatch"}
    assert {pickler for pickler, _ in rows} == {"pickle-5", "cloudpickle"}  # Ray's is installed
    for pickler in ("pickle-5", "cloudpickle"):
        assert rows[pickler, "WireBatch"]["bytes"] < rows[pickler, "WireDelta list"]["bytes"]
    assert all(r["dumps_us"] > 0 and r["loads_us"] > 0 for r in rows.values())
    assert "16 deltas a batch" in capsys.readouterr().out


def test_sampling_params_cross_as_the_object_the_ingress_validated(monkeypatch):
    """An engine call's SamplingParams reach the replica as they were built and validated
    (deployments/ingress.py): unpickling neither validates nor normalizes them again."""
    from ray import cloudpickle

    from deployments.engine_replica import EngineCall

    params = SamplingParams(max_tokens=7, stop="x", logit_bias={"3": 1}, json_schema='{"type": "integer"}')
    call = EngineCall("r", [1, 2], params)
    data = cloudpickle.dumps(call)

    def validate(self):
        raise AssertionError("validated again")

    monkeypatch.setattr(SamplingParams, "validate", validate)
    loaded = pickle.loads(data)
    assert type(loaded.params) is SamplingParams and loaded.params == params
    assert loaded.params.logit_bias == {3: 1.0} and loaded.params.json_schema == {"type": "integer"}
