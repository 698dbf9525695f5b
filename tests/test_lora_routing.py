"""Routing LoRA requests across engine replicas (router/adapter_affinity.py), without Ray:
the adapter a real EngineCall asks for, each replica's tier from its routing stats (GPU
pool, then host memory, then any), the policy's ranking by tier, and the Serve router
driven with fake replicas. tests/test_lora_http.py runs it on a real two-replica app."""
from __future__ import annotations

import asyncio

from deployments.engine_replica import EngineCall
from engine import SamplingParams
from router.adapter_affinity import AdapterTier, adapter_tier, by_adapter_tier, lora_of
from router.policy import Candidate, Decision, PolicyConfig, choose
from router.request_router import extract_lora
from test_router_rendezvous import NAMES, fleet, make_router, pending, prompts, route

GPU, CPU, ELSEWHERE = AdapterTier.IN_GPU, AdapterTier.IN_CPU, AdapterTier.ELSEWHERE


def call(prompt: list[int], lora: str | None) -> EngineCall:
    """What the ingress sends an engine replica for one choice."""
    return EngineCall("r", prompt, SamplingParams(max_tokens=4, lora=lora))


def test_the_adapter_of_a_call():
    assert extract_lora([call([1, 2], "tuned")], {}) == "tuned"
    assert extract_lora([], {"request": call([1, 2], None)}) is None
    assert lora_of({"sampling": {"lora": "x"}}) == "x"  # a dict of sampling settings
    assert lora_of({"params": None}) is None and lora_of(None) is None
    assert lora_of({"sampling": {"lora": 3}}) is None


def test_tier_of_a_replica_from_its_routing_stats():
    stats = {"loras": ["hot"], "loras_cpu": ["warm"]}
    assert adapter_tier(stats, "hot") is GPU
    assert adapter_tier(stats, "warm") is CPU
    assert adapter_tier(stats, "cold") is ELSEWHERE
    assert adapter_tier(None, "hot") is ELSEWHERE  # no report yet
    assert adapter_tier({}, None) is GPU  # the base model: every replica alike


def C(rid: str, tier: AdapterTier, load: float = 0) -> Candidate:
    return Candidate(rid, 0, load, 0.0, tier)


def test_policy_ranks_gpu_then_cpu_then_any_keeping_the_prefix_order_within_a_tier():
    ranked = [C("a", ELSEWHERE), C("b", CPU), C("c", GPU), C("d", CPU), C("e", GPU)]
    assert [c.replica_id for c in by_adapter_tier(ranked)] == ["c", "e", "b", "d", "a"]
    choice = choose(0, ranked)
    assert [r[0] for r in choice.ranks] == ["c", "e", "b", "d", "a"]
    assert choice.decision == Decision.NO_MATCH  # the first of its order: not an overflow
    # host memory beats a disk read when no replica has it in its GPU pool
    assert choose(0, [C("a", ELSEWHERE), C("b", CPU)]).ranks[0] == ["b"]
    # a holder past its load bound overflows to the next tier's first, as in any order
    busy = choose(0, [C("a", ELSEWHERE), C("b", CPU), C("c", GPU, load=40)],
                  PolicyConfig(abs_threshold=4))
    assert busy.ranks[0] == ["b"] and busy.decision == Decision.OVERFLOW


def test_router_sends_engine_calls_by_tier():
    """Through the Serve router with the ingress's real EngineCall: a replica holding the
    adapter in its GPU pool takes every prefix's request (unless past its load bound), then
    one holding it in host memory; with no holder, requests spread by prefix."""
    async def send(router, replicas, prompt: list[int], lora: str | None) -> str:
        pr = pending(call(prompt, lora))
        chosen = await route(router, replicas, pr)
        router.on_request_completed(None, pr.metadata.internal_request_id)
        return chosen

    async def scenario():
        router = make_router()
        replicas = fleet(num_running=0, num_waiting=0, ts=1000.0)
        replicas[1].routing_stats["loras_cpu"] = ["tuned", "warm"]
        replicas[3].routing_stats["loras"] = ["tuned"]
        router.update_replicas(replicas)
        assert {await send(router, replicas, p, "tuned") for p in prompts(20, seed=1)} == {NAMES[3]}
        assert {await send(router, replicas, p, "warm") for p in prompts(20, seed=2)} == {NAMES[1]}
        assert len({await send(router, replicas, p, "cold") for p in prompts(20, seed=3)}) > 1
        assert len({await send(router, replicas, p, None) for p in prompts(20, seed=4)}) > 1
        replicas[3].routing_stats.update(num_running=50)  # past its bound: overflow
        assert await send(router, replicas, prompts(1)[0], "tuned") != NAMES[3]

    asyncio.run(scenario())


def test_a_load_restored_at_start_acknowledges_its_broadcast_once():
    """A replica that started while a load was being broadcast applied it from the app's
    record: that broadcast is answered as done (not "already loaded"), once; a later load
    of the name, a different path, or an unload in between are not."""
    from deployments.lora_registry import UNLOADED, RestoredLoads

    restored = RestoredLoads({"kept": "/a/kept", "boot": UNLOADED})
    assert not restored.acknowledges("list_loras", ())
    assert not restored.acknowledges("load_lora", ("boot", "/a/boot"))  # unloaded: not a load
    assert restored.acknowledges("load_lora", ("kept", "/a/kept"))
    assert not restored.acknowledges("load_lora", ("kept", "/a/kept"))  # a second load: refused
    other = RestoredLoads({"kept": "/a/kept"})
    assert not other.acknowledges("load_lora", ("kept", "/b/elsewhere"))
    unloaded_since = RestoredLoads({"kept": "/a/kept"})
    assert not unloaded_since.acknowledges("unload_lora", ("kept",))
    assert not unloaded_since.acknowledges("load_lora", ("kept", "/a/kept"))
