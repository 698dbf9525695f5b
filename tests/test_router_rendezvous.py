"""Unit tests of routing that agrees across ingress replicas: rendezvous ranking, the policy
(digest correction, bounded-load overflow), and the Serve RequestRouter driven with fake
replicas (no Ray cluster; tests/test_routing_e2e.py runs it for real)."""
from __future__ import annotations

import asyncio
import random
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve._private.request_router.common import PendingRequest

from router.cache_digest import CacheDigest
from router.own_sends import OwnSends
from router.policy import Candidate, Decision, PolicyConfig, choose
from router.rendezvous import prefix_key, rank
from router.request_router import PrefixAwareRequestRouter, extract_token_ids

BS = 4
NAMES = [f"replica-{i}" for i in range(5)]


def toks(*blocks: int) -> list[int]:
    """A prompt of whole blocks, block k filled with value k."""
    return [v for v in blocks for _ in range(BS)]


# ---------------------------------------------------------------------------------------
# rendezvous ranking
# ---------------------------------------------------------------------------------------

def test_ranking_is_a_pure_function_of_key_and_ids():
    keys = [random.Random(i).getrandbits(64) for i in range(50)]
    for key in keys:
        order = rank(key, NAMES)
        assert sorted(order) == sorted(NAMES)
        assert rank(key, list(reversed(NAMES))) == order  # input order does not matter
    firsts = {rank(k, NAMES)[0] for k in keys}
    assert len(firsts) >= 4  # keys spread over the replicas
    # The same in another process with another hash seed (ingresses are other processes).
    code = ("from router.rendezvous import rank; "
            f"print([rank(k, {NAMES!r})[0] for k in {keys[:10]!r}])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "99", "PYTHONPATH": "."}).stdout
    assert out.strip() == str([rank(k, NAMES)[0] for k in keys[:10]])


def test_prefix_key_uses_the_leading_blocks():
    assert prefix_key([], 4) is None
    assert prefix_key([11, 22], 4) == 22  # shorter than the depth: its last full block
    assert prefix_key([11, 22, 33, 44, 55, 66], 4) == 44  # the tail does not change it
    with pytest.raises(ValueError):
        prefix_key([1], 0)


def test_a_leaving_replica_moves_only_its_prefixes_and_a_joining_one_takes_only_its_own():
    keys = [random.Random(i).getrandbits(64) for i in range(2000)]
    before = {k: rank(k, NAMES)[0] for k in keys}
    gone = NAMES[2]
    after = {k: rank(k, [n for n in NAMES if n != gone])[0] for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == gone}
    assert 250 < len(moved) < 550  # about a fifth
    joined = {k: rank(k, NAMES + ["replica-new"])[0] for k in keys}
    moved = {k for k in keys if before[k] != joined[k]}
    assert all(joined[k] == "replica-new" for k in moved) and 200 < len(moved) < 480


# ---------------------------------------------------------------------------------------
# policy
# ---------------------------------------------------------------------------------------

def C(rid: str, matched: int = 0, load: float = 0, kv: float = 0.0) -> Candidate:
    return Candidate(rid, matched, load, kv)


CFG = PolicyConfig(abs_threshold=4, rel_threshold=1.5, min_match_ratio=0.25)


def test_policy_first_choice_without_load_or_digests():
    assert choose(4, [], CFG).ranks == []
    c = choose(8, [C("a"), C("b"), C("c")], CFG)
    assert c.ranks == [["a"], ["b"], ["c"]] and c.decision == Decision.NO_MATCH
    c = choose(8, [C("a", matched=8), C("b"), C("c")], CFG)
    assert c.decision == Decision.AFFINITY and c.matched_blocks == 8 and not c.corrected


def test_policy_digest_correction_needs_a_worthwhile_longer_match():
    # b holds 6 of 8 blocks, the first choice a holds none: b goes first.
    c = choose(8, [C("a"), C("b", matched=6), C("c", matched=3)], CFG)
    assert c.ranks == [["b"], ["c"], ["a"]] and c.corrected and c.decision == Decision.AFFINITY
    # One block more (below 25% of 8) is not worth leaving the first choice for.
    c = choose(8, [C("a", matched=5), C("b", matched=6)], CFG)
    assert c.ranks[0] == ["a"] and not c.corrected
    # Equal matches keep the rendezvous order: no flapping between two holders.
    assert choose(8, [C("a", matched=6), C("b", matched=6)], CFG).ranks[0] == ["a"]


def test_policy_bounded_load_overflows_along_the_prefix_ranking():
    # fair = (9 + 0 + 0 + 1) / 3 = 3.33; a at 9 is past both 3.33 + 4 and 1.5 x 3.33.
    order = [C("a", matched=8, load=9), C("b", load=0), C("c", load=0)]
    c = choose(8, order, CFG)
    assert c.ranks == [["b"], ["a"], ["c"]] and c.decision == Decision.OVERFLOW
    # The next in the prefix's own order, not the least loaded: b at 2 still takes it.
    c = choose(8, [C("a", load=12), C("b", load=2), C("c", load=0)], CFG)
    assert c.ranks[0] == ["b"] and c.decision == Decision.OVERFLOW
    # Within the slack, affinity holds.
    c = choose(8, [C("a", matched=8, load=5), C("b", load=0), C("c", load=0)], CFG)
    assert c.ranks[0] == ["a"] and c.decision == Decision.AFFINITY
    # Deterministic: the same inputs give the same answer, every time.
    assert all(choose(8, order, CFG) == choose(8, order, CFG) for _ in range(5))


def test_policy_kv_high_water_and_load_fallback():
    cfg = PolicyConfig(abs_threshold=4, min_match_ratio=0.25, kv_high_water=0.8)
    c = choose(8, [C("a", matched=8, kv=0.9), C("b")], cfg)
    assert c.ranks == [["b"], ["a"]] and c.decision == Decision.OVERFLOW
    assert choose(8, [C("a", kv=0.9), C("b", kv=0.95)], cfg).ranks[0] == ["a"]  # all hot
    # Without slack every replica can be past its bound: the least loaded then.
    cfg = PolicyConfig(abs_threshold=0, rel_threshold=1.0)
    c = choose(8, [C("a", load=3), C("b", load=2), C("c", load=1)], cfg)
    assert c.ranks[0] == ["c"] and c.decision == Decision.OVERFLOW
    c = choose(8, [C("a", load=3), C("b", load=3), C("c", load=3)], cfg)
    assert c.ranks[0] == ["a"] and c.decision == Decision.LOAD_FALLBACK


# ---------------------------------------------------------------------------------------
# own sends
# ---------------------------------------------------------------------------------------

def test_own_sends_count_only_what_the_report_cannot_show():
    sends = OwnSends(pick_ttl_s=2.0)
    for i, t in enumerate((10.0, 11.0, 12.0)):
        sends.pick(f"r{i}", "a", t)
        sends.sent(f"r{i}", "a", t + 0.1)
    assert sends.count("a") == 3 and sends.unreported("a", since=10.5) == 2
    sends.pick("r3", "a", 13.0)
    sends.sent("r3", "b", 13.1)  # a was full: Serve sent it to b
    assert sends.count("a") == 3 and sends.unreported("b", since=12.5) == 1
    sends.completed("r1")
    assert sends.unreported("a", since=10.5) == 1
    sends.pick("lost", "a", 20.0)  # never sent (cancelled): expires after the TTL
    sends.pick("r9", "c", 30.0)
    assert sends.count("a") == 2
    sends.forget_replica("b")
    assert sends.count("b") == 0


# ---------------------------------------------------------------------------------------
# the Serve RequestRouter
# ---------------------------------------------------------------------------------------

DEP = DeploymentID(name="engine", app_name="app")


class FakeReplica:
    """The parts of RunningReplica the router touches."""

    def __init__(self, name: str, **stats: Any) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEP)
        self.routing_stats: dict[str, Any] = dict(stats)
        self.max_ongoing_requests = 100

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


@dataclass
class Req:
    prompt_token_ids: list[int]


_ids = iter(range(10**9))


def pending(arg: Any = None, **kwargs: Any) -> PendingRequest:
    rid = f"req-{next(_ids)}"
    return PendingRequest(args=[] if arg is None else [arg], kwargs=kwargs,
                          metadata=RequestMetadata(request_id=rid, internal_request_id=rid))


def make_router(clock: list[float] | None = None, **kwargs: Any) -> PrefixAwareRequestRouter:
    t = clock if clock is not None else [1000.0]
    router = PrefixAwareRequestRouter(
        deployment_id=DEP, handle_source=DeploymentHandleSource.UNKNOWN,
        get_curr_time_s=lambda: t[0])
    router.initialize_state(**{"block_size": BS, "key_blocks": 2, "abs_threshold": 4,
                               "rel_threshold": 1.5, "min_match_ratio": 0.25, **kwargs})
    return router


def fleet(**stats: Any) -> list[FakeReplica]:
    return [FakeReplica(n, **stats) for n in NAMES[:4]]


async def route(router, replicas, pr, to: FakeReplica | None = None) -> str:
    """choose_replicas, then Serve sends it to the pick (or to `to`)."""
    ranks = await router.choose_replicas(replicas, pr)
    chosen = to or ranks[0][0]
    router.on_request_routed(pr, chosen.replica_id, result=None)
    return chosen.replica_id.unique_id


async def route_done(router, replicas, prompt: list[int]) -> str:
    """Route one request that finishes at once (no load builds up)."""
    pr = pending(Req(prompt))
    chosen = await route(router, replicas, pr)
    router.on_request_completed(None, pr.metadata.internal_request_id)
    return chosen


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [toks(*(rng.randrange(100, 10**6) for _ in range(4))) for _ in range(n)]


def test_extract_token_ids_contract():
    assert extract_token_ids([Req([1, 2])], {}) == [1, 2]
    assert extract_token_ids([{"prompt_token_ids": (3,)}], {}) == [3]
    assert extract_token_ids([], {"request": Req([4])}) == [4]
    assert extract_token_ids([object()], {}) is None
    assert extract_token_ids([], {}) is None
    assert extract_token_ids([{"prompt_token_ids": "nope"}], {}) is None


def test_routers_that_saw_different_traffic_rank_alike():
    """Two ingresses: one has routed 200 requests (still in flight, reported by the replicas),
    the other none; they pick the same replica for every prompt, and each burst of a shared
    prefix stays on one replica."""
    async def scenario():
        busy, fresh = make_router(), make_router()
        replicas = fleet()
        busy.update_replicas(replicas)
        fresh.update_replicas(replicas)
        for p in prompts(200, seed=1):
            await route(busy, replicas, pending(Req(p)))
        for r in replicas:  # the replicas report it all (after those sends)
            r.routing_stats = {"num_running": busy._sends.count(r.replica_id), "ts": 1001.0}
        busy.update_replicas(replicas)
        fresh.update_replicas(replicas)
        loads = [busy._load(r) for r in replicas]
        assert loads == [fresh._load(r) for r in replicas] and sum(loads) == 200
        for p in prompts(100, seed=2):
            a = (await busy.choose_replicas(replicas, pending(Req(p))))
            b = (await fresh.choose_replicas(replicas, pending(Req(p))))
            assert [[r.replica_id for r in rank] for rank in a] == [[r.replica_id for r in rank] for rank in b]
        prefix = toks(7, 8)
        homes = {await route(r, replicas, pending(Req(prefix + toks(50 + i)))) for i in range(6)
                 for r in (busy, fresh)}
        assert len(homes) == 1
    asyncio.run(scenario())


def test_overflow_is_the_same_next_replica_on_every_router():
    async def scenario():
        prefix = toks(3, 4)
        replicas = fleet()
        order = rank(prefix_key(make_router()._index.hashes(prefix), 2), NAMES[:4])
        # The prefix's first choice reports 30 requests, the others 2: past its bound.
        for r in replicas:
            r.routing_stats = {"num_running": 30 if r.replica_id.unique_id == order[0] else 2,
                               "ts": 1000.0}
        picks = set()
        for _ in range(3):
            router = make_router()
            router.update_replicas(replicas)
            picks.add(await route(router, replicas, pending(Req(prefix + toks(9)))))
            assert router.router_stats()["overflows"] == 1
        assert picks == {order[1]}
    asyncio.run(scenario())


def test_own_sends_since_the_report_count_towards_the_bound():
    """A burst through one ingress before any report: its own sends fill the first choice
    to fair share + slack, then the prefix overflows along its own ranking, the same way
    on a second router."""
    async def burst() -> tuple[list[str], dict]:
        router = make_router()
        replicas = fleet(num_running=0, num_waiting=0, ts=999.0)
        router.update_replicas(replicas)
        picks = [await route(router, replicas, pending(Req(prefix + toks(100 + i)))) for i in range(20)]
        return picks, router.router_stats()

    prefix = toks(5, 6)
    order = rank(prefix_key(make_router()._index.hashes(prefix), 2), NAMES[:4])
    picks, stats = asyncio.run(burst())
    assert picks[:5] == [order[0]] * 5 and picks[5] == order[1], picks
    assert set(picks) <= set(order[:3]) and asyncio.run(burst())[0] == picks
    assert stats["overflows"] == sum(p != order[0] for p in picks) >= 5
    assert stats["routed_without_match"] == 20  # no digest yet: honest "no match"


def test_digest_correction_and_counters():
    async def scenario():
        clock = [1000.0]
        router = make_router(clock)
        replicas = fleet()
        prefix = toks(1, 2, 3, 4)
        order = rank(prefix_key(router._index.hashes(prefix), 2), NAMES[:4])
        holder = next(r for r in replicas if r.replica_id.unique_id == order[2])
        truth = CacheDigest(block_size=BS, clock=lambda: clock[0])
        truth.insert(prefix)
        holder.routing_stats = {"cache_digest": truth.encode()}
        router.update_replicas(replicas)
        assert await route(router, replicas, pending(Req(prefix + toks(9)))) == order[2]
        # Serve sent the next one elsewhere (the pick was full): a misroute.
        other = next(r for r in replicas if r is not holder)
        await route(router, replicas, pending(Req(prefix)), to=other)
        stats = router.router_stats()
        assert stats["digest_corrections"] == 2 and stats["misroutes"] == 1
        assert stats["routed_with_match"] == 1 and stats["routed_without_match"] == 1
        assert stats["predicted_matched_tokens"] == 4 * BS
        # The holder evicts it: its next digest sends the prefix back to its first choice.
        truth.evict(prefix, 0)
        holder.routing_stats = {"cache_digest": truth.encode()}
        router.update_replicas(replicas)
        assert await route(router, replicas, pending(Req(prefix))) == order[0]
        holder.routing_stats = {"cache_digest": b"junk"}
        router.update_replicas(replicas)
        assert router.router_stats()["digest_errors"] == 1
    asyncio.run(scenario())


def test_a_leaving_replica_moves_only_its_prefixes_through_the_router():
    async def scenario():
        router = make_router()
        replicas = fleet()
        router.update_replicas(replicas)
        ps = prompts(200, seed=3)
        before = [await route_done(router, replicas, p) for p in ps]
        gone = replicas[1]
        router.on_replica_actor_died(gone.replica_id)
        rest = [r for r in replicas if r is not gone]
        router.update_replicas(rest)
        assert router.router_stats()["replicas_tracked"] == 3
        assert router._sends.count(gone.replica_id) == 0
        after = [await route_done(router, rest, p) for p in ps]
        moved = [i for i in range(len(ps)) if before[i] != after[i]]
        assert moved and all(before[i] == gone.replica_id.unique_id for i in moved)
        assert gone.replica_id.unique_id not in after
    asyncio.run(scenario())


def test_a_joining_replica_takes_new_prefixes_only_while_digests_hold_the_cached_ones():
    async def scenario():
        router = make_router()
        replicas = fleet()
        router.update_replicas(replicas)
        ps = prompts(120, seed=4)
        before = [await route_done(router, replicas, p) for p in ps]
        digests = {r.replica_id.unique_id: CacheDigest(block_size=BS) for r in replicas}
        for p, home in zip(ps, before):  # each replica caches what it served
            digests[home].insert(p)
        for r in replicas:
            r.routing_stats = {"cache_digest": digests[r.replica_id.unique_id].encode()}
        new = FakeReplica(NAMES[4])
        grown = replicas + [new]
        router.update_replicas(grown)
        assert [await route_done(router, grown, p) for p in ps] == before  # nothing moved
        fresh = [await route_done(router, grown, p) for p in prompts(120, seed=5)]
        assert 10 < fresh.count(NAMES[4]) < 45  # about a fifth of the new prefixes
        assert router.router_stats()["digest_corrections"] > 0
    asyncio.run(scenario())


def test_requests_without_tokens_spread_and_load_without_a_timestamp():
    async def scenario():
        router = make_router()
        replicas = fleet()
        router.update_replicas(replicas)
        picks = {await route(router, replicas, pending("plain text")) for _ in range(40)}
        assert len(picks) >= 3 and router.router_stats()["requests_without_tokens"] == 40
        ranks = await router.choose_replicas(replicas, pending(request={"prompt_token_ids": toks(1)}))
        assert len(ranks) == 4
        # A report without "ts": the larger of the report and this router's own count.
        a = replicas[0]
        a.routing_stats = {"num_running": 1}
        assert router._load(a) == max(1, router._sends.count(a.replica_id))
        assert await router.choose_replicas([], pending(Req([1]))) == []
    asyncio.run(scenario())


def test_router_sends_a_channel_only_to_its_replica_and_nowhere_once_it_left():
    from deployments.channel import ChannelOpen

    async def scenario():
        router = make_router()
        a, b = FakeReplica("a"), FakeReplica("b")
        router.update_replicas([a, b])
        ranks = await router.choose_replicas([a, b], pending(ChannelOpen("ingress", "b")))
        assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == [["b"]]
        router.update_replicas([a])  # b scaled in: a channel for it waits, never lands on a
        ranks = await router.choose_replicas([a], pending(ChannelOpen("ingress", "b")))
        assert all(not rank for rank in ranks)
    asyncio.run(scenario())
