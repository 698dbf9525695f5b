"""The prefix fetch cost model (router/fetch_cost.py) and the router naming a holder on a
request it sends away from the prefix (router/fetch_hints.py): the ranking of a GPU holder,
a host holder, a replica that fetches and one that computes; the holder's queue moving the
request; the hint set, cleared and kept off LoRA requests; a fetch call pinned to its
holder; the policy's choice of replica weighing host-tier holdings by the cost model.
No Ray cluster (tests/test_prefix_fetch_http.py runs it on two nodes)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from router.cache_digest import CacheDigest
from router import rendezvous
from router.fetch_cost import FetchCosts, Holding, host_weight, plan, rank
from router.policy import Candidate, PolicyConfig, choose
from router.prefix_index import block_hashes
from test_router_rendezvous import BS, FakeReplica, make_router, pending, toks

PROMPT = 1024
COSTS = FetchCosts()


def order(holdings: list[Holding], prompt: int = PROMPT, costs: FetchCosts = COSTS) -> list[str]:
    return [p.replica_id for p in rank(holdings, prompt, costs)]


def test_gpu_holder_then_host_holder_then_a_fetcher_then_a_recompute():
    gpu = Holding("gpu", gpu_tokens=1000)
    host = Holding("host", gpu_tokens=200, host_tokens=800)
    fresh = Holding("fresh")
    for holdings in ([fresh, host, gpu], [gpu, fresh, host], [host, gpu, fresh]):
        assert order(holdings) == ["gpu", "host", "fresh"]
    plans = {p.replica_id: p for p in rank([fresh, host, gpu], PROMPT)}
    assert plans["fresh"].fetch_from == "gpu" and plans["fresh"].fetched_tokens == 1000
    assert plans["gpu"].fetch_from is None and plans["host"].fetch_from is None
    # without a holder anywhere, nobody fetches: a computing replica comes last
    alone = rank([Holding("a"), Holding("b", gpu_tokens=500)], PROMPT)
    assert [p.replica_id for p in alone] == ["b", "a"] and alone[1].fetch_from == "b"
    assert rank([Holding("a"), Holding("b")], PROMPT)[0].fetch_from is None


def test_a_holders_queue_sends_the_request_to_a_replica_that_fetches():
    idle = Holding("other")
    assert order([idle, Holding("holder", gpu_tokens=1000)]) == ["holder", "other"]
    busy = Holding("holder", gpu_tokens=1000, load=10)
    best = rank([busy, idle], PROMPT)[0]
    assert best.replica_id == "other" and best.fetch_from == "holder"
    # a long queue on the fetcher too: back to the holder
    assert order([busy, Holding("other", load=10)]) == ["holder", "other"]


def test_fetching_only_where_it_beats_computing():
    holder = Holding("h", gpu_tokens=32)
    # a short prefix costs less to compute than the calls of a fetch
    assert plan(Holding("r"), [holder], 40, COSTS).fetch_from is None
    assert plan(Holding("r"), [Holding("h", gpu_tokens=512)], 520, COSTS).fetch_from == "h"
    # a fetch as slow as computing never wins
    slow = FetchCosts(fetch_s_per_token=COSTS.compute_s_per_token)
    assert plan(Holding("r"), [Holding("h", gpu_tokens=512)], 520, slow).fetch_from is None
    # only what the receiver lacks is fetched, from the replica holding the most
    p = plan(Holding("r", gpu_tokens=256), [Holding("h1", gpu_tokens=512),
                                             Holding("h2", gpu_tokens=900)], PROMPT, COSTS)
    assert (p.fetch_from, p.fetched_tokens) == ("h2", 900 - 256)
    assert plan(Holding("r", gpu_tokens=600), [Holding("h", gpu_tokens=512)], PROMPT).fetch_from is None
    with pytest.raises(ValueError):
        FetchCosts(fetch_overhead_s=-1)


@dataclass
class Call:
    """The fields of deployments.engine_replica.EngineCall the router reads and writes."""

    prompt_token_ids: list[int]
    fetch_from: str | None = None


def held_by(replica: FakeReplica, tokens: list[int], **stats) -> None:
    digest = CacheDigest(block_size=BS)
    digest.insert(tokens)
    replica.routing_stats = {"cache_digest": digest.encode(), **stats}


def test_the_router_names_the_busy_holder_on_a_request_it_sends_elsewhere():
    async def scenario():
        router = make_router(abs_threshold=0, rel_threshold=1.0)
        holder, other = FakeReplica("holder"), FakeReplica("other", num_running=0, ts=999.0)
        prefix = toks(*range(1, 65))  # 64 blocks: worth fetching
        held_by(holder, prefix, num_running=0, ts=999.0)
        router.update_replicas([holder, other])
        call = Call(prefix + toks(99))
        ranks = await router.choose_replicas([holder, other], pending(call))
        assert ranks[0][0] is holder and call.fetch_from is None  # the holder itself: nothing to fetch
        held_by(holder, prefix, num_running=3, ts=999.0)
        router.update_replicas([holder, other])
        call = Call(prefix + toks(98), fetch_from="stale")
        ranks = await router.choose_replicas([holder, other], pending(call))
        assert ranks[0][0] is other and call.fetch_from == "holder"
        # a short shared prefix is computed, not fetched: no holder named
        short = Call(prefix[:BS] + toks(97))
        await router.choose_replicas([holder, other], pending(short))
        assert short.fetch_from is None
    asyncio.run(scenario())


def test_no_holder_for_lora_requests_or_calls_without_the_field():
    @dataclass
    class LoRACall:
        prompt_token_ids: list[int]
        sampling: dict
        fetch_from: str | None = None

    async def scenario():
        router = make_router(abs_threshold=0, rel_threshold=1.0)
        holder, other = FakeReplica("holder"), FakeReplica("other", num_running=0, ts=999.0)
        prefix = toks(*range(1, 65))
        held_by(holder, prefix, num_running=3, ts=999.0)
        router.update_replicas([holder, other])
        call = LoRACall(prefix + toks(99), {"lora": "a"})
        await router.choose_replicas([holder, other], pending(call))
        assert call.fetch_from is None  # the digests hold the base model's prefixes only
        plain = {"prompt_token_ids": prefix + toks(98)}
        ranks = await router.choose_replicas([holder, other], pending(plain))
        assert ranks[0][0] is other and "fetch_from" not in plain
    asyncio.run(scenario())


def test_a_fetch_goes_only_to_its_holder():
    from deployments.prefix_fetch import PrefixFetch

    async def scenario():
        router = make_router()
        a, b = FakeReplica("a"), FakeReplica("b")
        router.update_replicas([a, b])
        ranks = await router.choose_replicas([a, b], pending(PrefixFetch("b", toks(1, 2))))
        assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == [["b"]]
        # the holder is gone: the call waits here (the receiver gives up on the holder's
        # death, deployments/prefix_fetch.py)
        router.update_replicas([a])
        ranks = await router.choose_replicas([a], pending(PrefixFetch("b", toks(1, 2))))
        assert all(not rank for rank in ranks)
    asyncio.run(scenario())


def test_the_digests_say_which_holder_keeps_the_prefix_on_its_gpu():
    """Two holders of the same prefix, one with it on its host tier only (its digest says
    so): the replica the router sends the request to fetches from the other."""
    prefix = toks(*range(1, 65))

    def digest(on_host: bool, **stats) -> dict:
        d = CacheDigest(block_size=BS)
        d.insert(prefix)
        if on_host:
            d.move(prefix, 0, to_host=True)
        return {"cache_digest": d.encode(), **stats}

    async def holder_for(host_first: bool) -> str | None:
        router = make_router(abs_threshold=0, rel_threshold=1.0)
        a = FakeReplica("a", **digest(host_first, num_running=3, ts=999.0))
        b = FakeReplica("b", **digest(not host_first, num_running=3, ts=999.0))
        c = FakeReplica("c", num_running=0, ts=999.0)
        router.update_replicas([a, b, c])
        call = Call(prefix + toks(99))
        ranks = await router.choose_replicas([a, b, c], pending(call))
        assert ranks[0][0] is c
        return call.fetch_from

    assert asyncio.run(holder_for(host_first=True)) == "b"
    assert asyncio.run(holder_for(host_first=False)) == "a"
    # the host part costs its load on the holder's own plan
    assert plan(Holding("h", 0, 512), [], 520).estimate_s > plan(Holding("g", 512), [], 520).estimate_s


# -- the policy's choice of replica: host-tier holdings count, weighted by the costs --------

def test_the_policy_ranks_a_host_holder_below_a_gpu_holder_above_none():
    cfg = PolicyConfig(abs_threshold=4, min_match_ratio=0.25)
    none, host, gpu = Candidate("none"), Candidate("host", 8, host_blocks=8), Candidate("gpu", 8)
    for rest in ([host, gpu], [gpu, host]):
        assert [r[0] for r in choose(8, [none, *rest], cfg).ranks] == ["gpu", "host", "none"]
    # more held on the host beats less on the GPU: loading is far cheaper than computing
    fewer = Candidate("gpu", 5)
    assert [r[0] for r in choose(8, [none, fewer, host], cfg).ranks] == ["host", "gpu", "none"]
    # the first choice holding it on its host stays first: the GPU holder saves too little
    assert choose(8, [host, none, gpu], cfg).ranks[0] == ["host"]
    # a host as slow to load from as computing: its holdings are worth nothing
    slow = FetchCosts(host_load_s_per_token=FetchCosts().compute_s_per_token)
    assert host_weight(slow) == 0.0 and 0.9 < host_weight(FetchCosts()) < 1.0
    worthless = PolicyConfig(abs_threshold=4, min_match_ratio=0.25, host_weight=host_weight(slow))
    assert choose(8, [none, host], worthless).ranks[0] == ["none"]
    assert choose(8, [none, host], cfg).ranks[0] == ["host"]
    with pytest.raises(ValueError):
        PolicyConfig(host_weight=1.5)


def test_the_router_ranks_by_the_tiers_its_digests_report():
    """Three idle replicas: the prefix's first choice holds nothing, the second holds the
    prefix on its host tier only, the third on its GPU; the router sends the request to
    the GPU holder, then the host holder. With `fetch_costs` that make the host as slow
    as computing, the host holder is no better than nothing."""
    prefix = toks(*range(1, 33))

    def digest(on_host: bool) -> dict:
        d = CacheDigest(block_size=BS)
        d.insert(prefix)
        if on_host:
            d.move(prefix, 0, to_host=True)
        return {"cache_digest": d.encode(), "num_running": 0, "ts": 999.0}

    async def order(**router_kwargs) -> list[str]:
        router = make_router(**router_kwargs)
        names = ["r0", "r1", "r2"]
        key = rendezvous.prefix_key(block_hashes(prefix, BS), 2)
        home, second, third = rendezvous.rank(key, names)
        replicas = [FakeReplica(home, num_running=0, ts=999.0),
                    FakeReplica(second, **digest(on_host=True)),
                    FakeReplica(third, **digest(on_host=False))]
        router.update_replicas(replicas)
        ranks = await router.choose_replicas(replicas, pending(Call(prefix + toks(99))))
        roles = {home: "none", second: "host", third: "gpu"}
        return [roles[r[0].replica_id.unique_id] for r in ranks]

    assert asyncio.run(order()) == ["gpu", "host", "none"]
    slow = {"host_load_s_per_token": FetchCosts().compute_s_per_token}
    assert asyncio.run(order(fetch_costs=slow)) == ["gpu", "none", "host"]
