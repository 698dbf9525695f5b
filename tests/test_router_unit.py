"""Unit tests of the prefix-aware router: hashing, index, replica digest, policy, and the
Serve RequestRouter driven with fake replicas (no Ray cluster)."""
from __future__ import annotations

import asyncio
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.cache_digest import CacheDigest, Digest, decode_digest
from router.policy import Candidate, Decision, PolicyConfig, choose, is_imbalanced
from router.prefix_index import PrefixIndex, block_hashes

# ---------------------------------------------------------------------------------------
# block_hashes
# ---------------------------------------------------------------------------------------

# Computed once; must never change (routers and replicas in different processes, and
# across releases, compare these values).
GOLDEN_RANGE32_B16 = [10251598853290956434, 14413796365232270483]


def test_block_hashes_golden_values():
    assert block_hashes(list(range(32)), 16) == GOLDEN_RANGE32_B16


def test_block_hashes_stable_across_processes():
    code = "from router.prefix_index import block_hashes; print(block_hashes(list(range(32)), 16))"
    for seed in ("0", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True,
            env={"PYTHONHASHSEED": seed, "PYTHONPATH": "."},
        ).stdout
        assert out.strip() == str(GOLDEN_RANGE32_B16)


def test_block_hashes_partial_blocks_and_chaining():
    assert block_hashes([1, 2, 3], 4) == []
    assert len(block_hashes(list(range(11)), 4)) == 2
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4)
    assert a[0] == b[0] and a[1] != b[1]
    # Chaining: the same block after a different prefix hashes differently.
    c = block_hashes([0, 0, 0, 0, 5, 6, 7, 8], 4)
    assert c[1] != a[1]
    # Tuples and lists agree; block size is part of the meaning.
    assert block_hashes(tuple(range(8)), 4) == block_hashes(list(range(8)), 4)
    with pytest.raises(ValueError):
        block_hashes([1], 0)


@given(st.lists(st.integers(0, 50_000), max_size=60), st.lists(st.integers(0, 50_000), max_size=60),
       st.integers(1, 8))
def test_block_hashes_prefix_property(a, b, bs):
    ha, hab = block_hashes(a, bs), block_hashes(a + b, bs)
    assert len(ha) == len(a) // bs and len(hab) == len(a + b) // bs
    assert hab[:len(ha)] == ha
    assert all(0 <= h < 2**64 for h in hab)


# ---------------------------------------------------------------------------------------
# PrefixIndex
# ---------------------------------------------------------------------------------------

def toks(*blocks: int, bs: int = 4) -> list[int]:
    """A prompt of whole blocks, block k filled with value k."""
    return [v for v in blocks for _ in range(bs)]


def test_index_match_and_record():
    idx = PrefixIndex(block_size=4)
    h = idx.hashes(toks(1, 2, 3))
    assert idx.match(h) == {}
    idx.record_routed("r1", h[:2])
    idx.record_routed("r2", idx.hashes(toks(1, 9)))
    assert idx.match(h) == {"r1": 2, "r2": 1}
    assert idx.match(h, ["r2", "unknown"]) == {"r2": 1, "unknown": 0}
    assert sorted(idx.replicas()) == ["r1", "r2"]
    # A hole at the front means no match, whatever follows.
    assert idx.match(idx.hashes(toks(7, 2, 3)))["r1"] == 0


def test_index_recency_eviction_under_bound():
    t = [0.0]
    idx = PrefixIndex(block_size=4, max_blocks_per_replica=4, clock=lambda: t[0])
    old, new = idx.hashes(toks(1, 2, 3)), idx.hashes(toks(5, 6, 7))
    idx.record_routed("r", old)
    t[0] = 1.0
    idx.record_routed("r", new)
    assert idx.num_blocks("r") == 4
    # The newest request is whole; of the old one only its head survives (leaves go first).
    assert idx.match(new)["r"] == 3
    assert idx.match(old)["r"] == 1
    # Touching the old prefix again makes it the most recent.
    idx.record_routed("r", old[:1])
    idx.record_routed("r", idx.hashes(toks(8)))
    assert idx.match(old)["r"] == 1 and idx.match(new)["r"] == 2


def test_index_remove_replica():
    idx = PrefixIndex(block_size=4)
    h = idx.hashes(toks(1, 2))
    idx.record_routed("r1", h)
    idx.record_routed("r2", [])  # learned without blocks
    assert sorted(idx.replicas()) == ["r1", "r2"]
    idx.remove_replica("r1")
    idx.remove_replica("nope")
    assert idx.replicas() == ["r2"] and idx.match(h) == {"r2": 0}


def test_index_forget_routed_drops_only_untouched_entries():
    idx = PrefixIndex(block_size=4)
    h = idx.hashes(toks(1, 2, 3, 4))
    idx.record_routed("r", h, now=1.0)  # a tentative record...
    idx.record_routed("r", h[:2], now=2.0)  # ...then another request shares its head
    assert idx.forget_routed("r", h, routed_at=1.0) == 2
    assert idx.match(h)["r"] == 2  # still prefix-closed: the shared head stays
    assert idx.forget_routed("r", h, routed_at=1.0) == 0
    assert idx.forget_routed("unknown", h, routed_at=1.0) == 0


def test_index_digest_forgets_evicted_keeps_just_routed():
    t = [100.0]
    idx = PrefixIndex(block_size=4, clock=lambda: t[0])
    evicted, held, inflight = (idx.hashes(toks(1, 2)), idx.hashes(toks(3, 4)),
                               idx.hashes(toks(5, 6)))
    idx.record_routed("r", evicted)  # routed at t=100, since evicted by the replica
    t[0] = 105.0
    idx.record_routed("r", inflight)  # routed after the replica took its snapshot
    digest = Digest(block_size=4, version=1, timestamp=104.0, hashes=held)
    assert idx.apply_digest("r", digest)
    assert idx.match(evicted)["r"] == 0
    assert idx.match(held)["r"] == 2
    assert idx.match(inflight)["r"] == 2
    # The same or an older version changes nothing.
    assert not idx.apply_digest("r", Digest(4, 1, 200.0, []))
    assert idx.match(held)["r"] == 2
    # A later digest without the in-flight prefix drops it once its grace has passed...
    assert idx.apply_digest("r", Digest(4, 2, 106.0, held))
    assert idx.match(inflight)["r"] == 0
    # ...but a grace window keeps entries routed shortly before the snapshot.
    idx.record_routed("r", inflight)
    assert idx.apply_digest("r", Digest(4, 3, 106.0, []), grace_s=2.0)
    assert idx.match(inflight)["r"] == 2 and idx.match(held)["r"] == 0
    with pytest.raises(ValueError):
        idx.apply_digest("r", Digest(16, 9, 0.0, []))


def test_index_digest_respects_bound_and_learns_new_replica():
    idx = PrefixIndex(block_size=4, max_blocks_per_replica=2)
    chain = idx.hashes(toks(1, 2, 3))
    # Digest order is oldest first; a replica sends chains root-last (newest).
    assert idx.apply_digest("new", Digest(4, 1, 0.0, list(reversed(chain))))
    assert idx.num_blocks("new") == 2 and idx.match(chain)["new"] == 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("ab"), st.lists(st.integers(0, 2), max_size=10)),
                max_size=25),
       st.integers(1, 6))
def test_index_bounded_and_prefix_closed(ops, bound):
    """Under any routing history the per-replica set stays within its bound and is closed
    under taking prefixes (eviction trims leaves, never chain heads)."""
    idx = PrefixIndex(block_size=2, max_blocks_per_replica=bound)
    parent: dict[int, int | None] = {}
    for rid, tokens in ops:
        h = idx.hashes(tokens)
        parent.update({x: (h[i - 1] if i else None) for i, x in enumerate(h)})
        idx.record_routed(rid, h)
        if len(h) <= bound:
            assert idx.match(h)[rid] == len(h)
    for rid in idx.replicas():
        assert idx.num_blocks(rid) <= bound
        for x, p in parent.items():
            if idx.holds(rid, x) and p is not None:
                assert idx.holds(rid, p)


# ---------------------------------------------------------------------------------------
# CacheDigest
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ev:
    kind: str
    tokens: tuple[int, ...]
    start: int


def held(d: CacheDigest, tokens, bs: int = 4) -> list[bool]:
    return [h in d for h in block_hashes(tokens, bs)]


def test_digest_insert_and_evict_whole_node():
    d = CacheDigest(block_size=4)
    t = tuple(range(10))
    d.apply(Ev("insert", t, 0))
    assert len(d) == 2 and held(d, t) == [True, True]
    # A node [4, 8): the block ending exactly at start=4 belongs to the ancestor.
    d2 = CacheDigest(block_size=4)
    d2.apply(Ev("insert", tuple(range(8)), 0))
    d2.apply(Ev("evict", tuple(range(8)), 4))
    assert held(d2, range(8)) == [True, False]
    d.apply(Ev("evict", t, 0))
    assert len(d) == 0


def test_digest_straddling_blocks():
    """A split at token 6 (inside block [4, 8)) followed by evictions of each side."""
    d = CacheDigest(block_size=4)
    old = tuple(range(1, 11))  # 1..10
    new = old[:6] + (99, 98, 97, 96)
    d.apply(Ev("insert", old, 0))
    d.apply(Ev("insert", new, 6))  # sibling branch from token 6
    assert len(d) == 3  # shared block [0,4) plus one straddling block per branch
    d.apply(Ev("evict", old, 6))  # old branch's node covers old[6:]
    assert held(d, old) == [True, False] and held(d, new) == [True, True]
    d.apply(Ev("evict", new, 6))
    assert held(d, new) == [True, False]
    d.apply(Ev("evict", new[:6], 0))  # the remaining parent node [0, 6)
    assert len(d) == 0
    # Evicting something never inserted is harmless.
    d.apply(Ev("evict", old, 0))
    with pytest.raises(ValueError):
        d.apply(Ev("bogus", old, 0))


def test_digest_encode_decode_roundtrip():
    t = [10.0]
    d = CacheDigest(block_size=4, clock=lambda: t[0])
    d.apply_all([Ev("insert", tuple(range(12)), 0), Ev("insert", (7,) * 8, 0)])
    first = decode_digest(d.encode())
    t[0] = 11.5
    second = CacheDigest.decode(d.encode())
    assert first.block_size == 4 and first.timestamp == 10.0 and second.timestamp == 11.5
    assert second.version > first.version
    assert first.hashes == d.hashes() and set(first.hashes) == set(
        block_hashes(range(12), 4) + block_hashes((7,) * 8, 4))
    # 8 bytes per hash plus a small header.
    assert len(d.encode()) <= 8 * len(d) + 48


def test_digest_decode_rejects_garbage():
    for bad in (b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"fmt": 99}),
                msgpack.packb({"fmt": 1, "bs": 4, "ver": 1, "ts": 0.0, "h": b"123"}),
                msgpack.packb({"fmt": 1, "bs": 0, "ver": 1, "ts": 0.0, "h": b""})):
        with pytest.raises(ValueError):
            decode_digest(bad)


def test_digest_size_bound_drops_oldest_inserted():
    d = CacheDigest(block_size=4, max_hashes=3)
    a, b = toks(1, 2), toks(3, 4)
    d.insert(a)
    d.insert(b)
    # a's deepest block was the oldest entry; chain heads survive.
    assert held(d, a) == [True, False] and held(d, b) == [True, True]
    d.insert(toks(1, 2, 3, 4, 5))  # a long chain: only its head fits
    assert len(d) == 3 and held(d, toks(1, 2, 3, 4, 5)) == [True, True, True, False, False]


@settings(max_examples=80, deadline=None)
@given(st.data(), st.integers(1, 4))
def test_digest_matches_token_level_model(data, bs):
    """Model: the set of held token prefixes. Insert adds all prefixes of `tokens`;
    evict removes the prefixes ending in (start, len] of an unbranched tail. The digest
    must equal the hashes of held prefixes whose length is a multiple of bs."""
    d = CacheDigest(block_size=bs, max_hashes=10_000)
    prefixes: set[tuple[int, ...]] = set()
    for _ in range(data.draw(st.integers(1, 15))):
        leaves = [p for p in prefixes if not any(len(q) == len(p) + 1 and q[:-1] == p
                                                  for q in prefixes)]
        if leaves and data.draw(st.booleans()):
            leaf = data.draw(st.sampled_from(sorted(leaves)))
            start = _deepest_branch_point(leaf, prefixes)
            start = data.draw(st.integers(start, len(leaf) - 1))
            d.apply(Ev("evict", leaf, start))
            prefixes -= {leaf[:k] for k in range(start + 1, len(leaf) + 1)}
        else:
            tokens = tuple(data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=12)))
            d.apply(Ev("insert", tokens, 0))
            prefixes |= {tokens[:k] for k in range(1, len(tokens) + 1)}
        expected = {block_hashes(p, bs)[-1] for p in prefixes if len(p) % bs == 0}
        assert set(d.hashes()) == expected


def _deepest_branch_point(leaf: tuple[int, ...], prefixes: set[tuple[int, ...]]) -> int:
    """The largest k < len(leaf) where leaf[:k] is the root or has two or more children:
    everything after it is an unbranched tail that a radix tree may evict."""
    for k in range(len(leaf) - 1, 0, -1):
        children = {q for q in prefixes if len(q) == k + 1 and q[:k] == leaf[:k]}
        if len(children) > 1:
            return k
    return 0


def test_digest_follows_real_radix_cache():
    """Contract check against the engine's own events (skipped if the engine moves)."""
    radix = pytest.importorskip("engine.core.radix_cache")
    slot_allocator = pytest.importorskip("engine.core.slot_allocator")
    import random

    rng = random.Random(0)
    alloc = slot_allocator.SlotAllocator(400)
    cache = radix.RadixCache(alloc, record_events=True)
    d = CacheDigest(block_size=4, max_hashes=10_000)
    base = [rng.randrange(3) for _ in range(9)]
    for step in range(60):
        if rng.random() < 0.7:
            tokens = base[:rng.randrange(10)] + [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
            slots = alloc.alloc(len(tokens))
            if slots is None:
                cache.evict(len(tokens))
                continue
            n = cache.insert(tokens, slots)
            alloc.free(slots[:n])
        else:
            cache.evict(rng.randrange(1, 20))
        d.apply_all(cache.drain_events())
        expected = {h for leaf in _leaf_paths(cache.root) for h in block_hashes(leaf, 4)}
        assert set(d.hashes()) == expected, step


def _leaf_paths(root) -> list[tuple[int, ...]]:
    out, stack = [], list(root.children.values())
    while stack:
        node = stack.pop()
        if node.children:
            stack.extend(node.children.values())
        else:
            out.append(node.path_tokens())
    return out


# ---------------------------------------------------------------------------------------
# policy
# ---------------------------------------------------------------------------------------

CFG = PolicyConfig(abs_threshold=4, rel_threshold=1.5, min_match_ratio=0.25, kv_high_water=0.9)


def C(rid: str, matched: int = 0, load: float = 0, kv: float = 0.0) -> Candidate:
    return Candidate(rid, matched, load, kv)


def test_policy_empty():
    c = choose(4, [], CFG)
    assert c.ranks == [] and c.decision == Decision.NO_MATCH


def test_policy_affinity_longest_match():
    c = choose(8, [C("a", 2, load=1), C("b", 6, load=3), C("c", 0, load=0)], CFG)
    assert c.decision == Decision.AFFINITY and c.ranks == [["b"], ["c", "a"]]
    assert c.matched_blocks == 6


def test_policy_affinity_ties_broken_by_load():
    c = choose(8, [C("a", 6, load=3), C("b", 6, load=1), C("c", 1, load=0)], CFG)
    assert c.decision == Decision.AFFINITY and c.ranks == [["b", "a"], ["c"]]


def test_policy_no_match_goes_to_least_loaded():
    c = choose(8, [C("a", load=3), C("b", load=1), C("c", load=2)], CFG)
    assert c.decision == Decision.NO_MATCH and c.ranks == [["b"], ["c", "a"]]
    # Equal loads: all of them share the first rank (Serve picks by queue length).
    c = choose(8, [C("a", load=1), C("b", load=1), C("c", load=2)], CFG)
    assert c.ranks == [["a", "b"], ["c"]]


def test_policy_short_match_below_ratio_is_no_match():
    c = choose(8, [C("a", 1, load=2), C("b", 0, load=0)], CFG)  # 1/8 < 0.25
    assert c.decision == Decision.NO_MATCH and c.ranks[0] == ["b"]
    assert choose(8, [C("a", 2, load=2), C("b", 0, load=0)], CFG).decision == Decision.AFFINITY
    assert choose(0, [C("a", 0, load=2), C("b", 0, load=0)], CFG).decision == Decision.NO_MATCH


def test_policy_imbalanced_falls_back_to_least_loaded():
    # max - min = 8 > 4 and 10 > 1.5 * 2: imbalanced, the match is ignored.
    c = choose(8, [C("a", 8, load=10), C("b", 0, load=2), C("c", 0, load=5)], CFG)
    assert c.decision == Decision.LOAD_FALLBACK and c.ranks == [["b"], ["c", "a"]]
    assert c.matched_blocks == 0


def test_policy_both_thresholds_needed_for_imbalance():
    # abs exceeded (100 - 90 > 4) but not rel (100 < 1.5 * 90): balanced.
    c = choose(8, [C("a", 8, load=100), C("b", 0, load=90)], CFG)
    assert c.decision == Decision.AFFINITY and c.ranks[0] == ["a"]
    # rel exceeded (3 > 1.5 * 1) but not abs (3 - 1 <= 4): balanced.
    c = choose(8, [C("a", 8, load=3), C("b", 0, load=1)], CFG)
    assert c.decision == Decision.AFFINITY
    assert is_imbalanced([0, 5], CFG) and not is_imbalanced([0, 4], CFG)
    assert not is_imbalanced([], CFG)


def test_policy_kv_high_water_counts_as_loaded():
    # The only holder is nearly full: route elsewhere, keep it as the last resort.
    c = choose(8, [C("hot", 8, load=0, kv=0.95), C("a", 0, load=2), C("b", 0, load=1)], CFG)
    assert c.decision == Decision.LOAD_FALLBACK and c.ranks == [["b"], ["a"], ["hot"]]
    # A hot replica without a useful match: plain no-match.
    c = choose(8, [C("hot", 0, kv=0.99), C("a", 0, load=2)], CFG)
    assert c.decision == Decision.NO_MATCH and c.ranks == [["a"], ["hot"]]
    # Hot replicas don't count towards imbalance either.
    c = choose(8, [C("hot", 0, load=0, kv=0.99), C("a", 8, load=10), C("b", 0, load=9)], CFG)
    assert c.decision == Decision.AFFINITY and c.ranks[0] == ["a"]


def test_policy_all_hot_is_treated_normally():
    c = choose(8, [C("a", 8, load=1, kv=0.95), C("b", 0, load=0, kv=0.99)], CFG)
    assert c.decision == Decision.AFFINITY and c.ranks == [["a"], ["b"]]


def test_policy_config_validation():
    for bad in (dict(abs_threshold=-1), dict(rel_threshold=0.5), dict(min_match_ratio=2),
                dict(kv_high_water=0)):
        with pytest.raises(ValueError):
            PolicyConfig(**bad)


candidates_st = st.lists(
    st.builds(Candidate, st.integers(0, 10**6).map(str), st.integers(0, 10),
              st.integers(0, 50), st.floats(0, 1)),
    min_size=1, max_size=8, unique_by=lambda c: c.replica_id)


@given(st.integers(0, 10), candidates_st)
def test_policy_properties(request_blocks, cands):
    c = choose(request_blocks, cands, CFG)
    flat = [rid for rank in c.ranks for rid in rank]
    assert sorted(flat) == sorted(x.replica_id for x in cands)  # a partition
    assert all(c.ranks)
    by_id = {x.replica_id: x for x in cands}
    first = [by_id[r] for r in c.ranks[0]]
    cool = [x for x in cands if x.kv_usage <= CFG.kv_high_water] or cands
    if c.decision == Decision.AFFINITY:
        assert all(x.matched_blocks == max(y.matched_blocks for y in cool) for x in first)
        assert c.matched_blocks / request_blocks >= CFG.min_match_ratio
    else:
        assert all(x.load == min(y.load for y in cool) for x in first)
    if is_imbalanced([x.load for x in cool], CFG):
        assert c.decision == Decision.LOAD_FALLBACK


# ---------------------------------------------------------------------------------------
# PrefixAwareRequestRouter with fake replicas (no cluster)
# ---------------------------------------------------------------------------------------

from ray.serve._private.common import (  # noqa: E402
    DeploymentHandleSource,
    DeploymentID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest, ReplicaID  # noqa: E402

from router.request_router import PrefixAwareRequestRouter, extract_token_ids  # noqa: E402

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
    router.initialize_state(block_size=4, abs_threshold=4, rel_threshold=1.5,
                            min_match_ratio=0.25, **kwargs)
    return router


async def route(router, replicas, pr) -> tuple[list[list[str]], FakeReplica]:
    """choose_replicas, then pretend Serve sent it to the first replica of rank 0."""
    ranks = await router.choose_replicas(replicas, pr)
    chosen = ranks[0][0]
    router.on_request_routed(pr, chosen.replica_id, result=None)
    return [[r.replica_id.unique_id for r in rank] for rank in ranks], chosen


def test_extract_token_ids_contract():
    assert extract_token_ids([Req([1, 2])], {}) == [1, 2]
    assert extract_token_ids([{"prompt_token_ids": (3,)}], {}) == [3]
    assert extract_token_ids([], {"request": Req([4])}) == [4]
    assert extract_token_ids([object()], {}) is None
    assert extract_token_ids([], {}) is None
    assert extract_token_ids([{"prompt_token_ids": "nope"}], {}) is None


def test_router_affinity_after_routing():
    async def scenario():
        router = make_router()
        a, b = FakeReplica("a"), FakeReplica("b")
        router.update_replicas([a, b])
        prompt = toks(1, 2, 3, 4)
        pr = pending(Req(prompt))
        ranks = await router.choose_replicas([a, b], pr)
        assert pr.routing_context.should_backoff  # no busy retry loop
        # Nobody holds it: least loaded (a tie, broken by the smaller cache, then order);
        # the first rank is always the one replica the router picked.
        assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == [["a"], ["b"]]
        router.on_request_routed(pr, b.replica_id, None)
        # The same prefix now goes to b, even with a different tail and a bit more load.
        router.on_request_routed(pending(Req(toks(9))), b.replica_id, None)
        ranks, chosen = await route(router, [a, b], pending(Req(prompt[:12] + toks(7))))
        assert ranks == [["b"], ["a"]]
        stats = router.router_stats()
        assert stats["routed_with_match"] == 1 and stats["routed_without_match"] == 2
        assert stats["predicted_matched_tokens"] == 12
        assert stats["load_fallbacks"] == 0 and stats["replicas_tracked"] == 2
    asyncio.run(scenario())


def test_router_load_fallback_from_routing_stats():
    async def scenario():
        router = make_router()
        a, b = FakeReplica("a", num_running=8, num_waiting=4), FakeReplica("b", num_running=1)
        router.update_replicas([a, b])
        prompt = toks(1, 2, 3, 4)
        router.on_request_routed(pending(Req(prompt)), a.replica_id, None)
        ranks, _ = await route(router, [a, b], pending(Req(prompt)))
        assert ranks == [["b"], ["a"]]  # 12 vs 1: imbalanced
        assert router.router_stats()["load_fallbacks"] == 1
        # Once a's queue drains, affinity returns (b, just given `prompt`, holds it too).
        a.routing_stats = {"num_running": 2, "num_waiting": 0}
        other = toks(5, 6, 7, 8)
        router.on_request_routed(pending(Req(other)), a.replica_id, None)
        ranks, _ = await route(router, [a, b], pending(Req(other)))
        assert ranks[0] == ["a"]
    asyncio.run(scenario())


def test_router_counts_own_in_flight_requests():
    async def scenario():
        router = make_router()
        a, b = FakeReplica("a"), FakeReplica("b")
        router.update_replicas([a, b])
        prs = [pending(Req(toks(i))) for i in range(6)]
        for pr in prs:
            router.on_request_routed(pr, a.replica_id, None)
        assert router._load(a) == 6
        for pr in prs:
            router.on_request_completed(a.replica_id, pr.metadata.internal_request_id)
        router.on_request_completed(a.replica_id, "never-routed")
        assert router._load(a) == 0
    asyncio.run(scenario())


def test_router_prefers_serve_queue_len_cache_for_load():
    async def scenario():
        router = PrefixAwareRequestRouter(
            deployment_id=DEP, handle_source=DeploymentHandleSource.UNKNOWN,
            use_replica_queue_len_cache=True)
        router.initialize_state(block_size=4, abs_threshold=4)
        a = FakeReplica("a", num_running=50)
        router.update_replicas([a])
        for _ in range(100):  # let Serve's background probe (queue len 0) land first
            if router.replica_queue_len_cache.get(a.replica_id) is not None:
                break
            await asyncio.sleep(0.01)
        router.replica_queue_len_cache.update(a.replica_id, 7)
        assert router._load(a) == 7  # fresher than the published stats
        router.replica_queue_len_cache.invalidate_key(a.replica_id)
        assert router._load(a) == 50
    asyncio.run(scenario())


def test_router_retries_reuse_one_routing():
    async def scenario():
        router = make_router()
        a, b = FakeReplica("a"), FakeReplica("b")
        router.update_replicas([a, b])
        pr = pending("no tokens here")
        for _ in range(3):  # Serve calls choose_replicas again after rejections
            await router.choose_replicas([a, b], pr)
        router.on_request_routed(pr, a.replica_id, None)
        assert router.router_stats()["requests_without_tokens"] == 1
        assert not router._routings  # nothing left behind
    asyncio.run(scenario())


def test_router_merges_digests_and_forgets_evicted_prefixes():
    async def scenario():
        clock = [1000.0]
        router = make_router(clock, digest_grace_s=0.0)
        truth = CacheDigest(block_size=4, clock=lambda: clock[0])
        prompt = toks(1, 2, 3, 4)
        truth.insert(prompt)
        a, b = FakeReplica("a"), FakeReplica("b", cache_digest=truth.encode())
        router.update_replicas([a, b])
        pr = pending(Req(prompt))
        ranks, _ = await route(router, [a, b], pr)
        assert ranks == [["b"], ["a"]]  # learned from b's own report
        router.on_request_completed(b.replica_id, pr.metadata.internal_request_id)
        # b evicts it; its next digest (taken after the last routing) withdraws it.
        truth.evict(prompt, 0)
        clock[0] += 5
        b.routing_stats = {"cache_digest": truth.encode()}
        router.update_replicas([a, b])
        ranks, _ = await route(router, [a, b], pending(Req(prompt)))
        assert ranks == [["a"], ["b"]] and router.router_stats()["digests_applied"] == 2
        # A broken digest is ignored, not fatal.
        a.routing_stats = {"cache_digest": b"junk"}
        router.update_replicas([a, b])
        assert router.router_stats()["digest_errors"] == 1
    asyncio.run(scenario())


def test_router_drops_replicas_that_leave():
    async def scenario():
        router = make_router()
        a, b, c = FakeReplica("a"), FakeReplica("b"), FakeReplica("c")
        router.update_replicas([a, b, c])
        for r in (a, b, c):
            router.on_request_routed(pending(Req(toks(1))), r.replica_id, None)
        router.update_replicas([a, b])  # c scaled down
        assert set(router._index.replicas()) == {a.replica_id, b.replica_id}
        router.on_replica_actor_died(b.replica_id)
        assert router._index.replicas() == [a.replica_id]
        assert b.replica_id not in router.curr_replicas
    asyncio.run(scenario())


def test_router_kv_high_water_and_requests_without_tokens():
    async def scenario():
        router = make_router(kv_high_water=0.8)
        a, b = FakeReplica("a", kv_usage=0.9), FakeReplica("b", kv_usage=0.1, num_running=3)
        router.update_replicas([a, b])
        router.on_request_routed(pending(Req(toks(1, 2))), a.replica_id, None)
        ranks, _ = await route(router, [a, b], pending(Req(toks(1, 2))))
        assert ranks == [["b"], ["a"]]
        # No token ids at all (or a dict/kwarg variant): routed by load alone.
        ranks, _ = await route(router, [a, b], pending("plain text"))
        assert ranks == [["b"], ["a"]]
        ranks, _ = await route(router, [a, b], pending(request={"prompt_token_ids": toks(1, 2)}))
        assert ranks[0] == ["b"]
        assert router.router_stats()["requests_without_tokens"] == 1
        assert await router.choose_replicas([], pending(Req([1]))) == []
    asyncio.run(scenario())


def test_router_burst_follows_the_first_pick_before_it_is_routed():
    async def scenario():
        router = make_router()
        a, b, c = FakeReplica("a"), FakeReplica("b"), FakeReplica("c")
        router.update_replicas([a, b, c])
        prefix = toks(1, 2, 3, 4, 5, 6)
        burst = [pending(Req(prefix + toks(10 + i))) for i in range(3)]
        firsts = [(await router.choose_replicas([a, b, c], pr))[0] for pr in burst]
        # Serve has not confirmed any of them yet: they still all go where the first went.
        assert len({rank[0].replica_id for rank in firsts}) == 1 and len(firsts[0]) == 1
        home = firsts[0][0]
        assert router._load(home) == 3  # chosen, not yet sent: counted as load
        # An unrelated request goes to a replica without those requests.
        ranks = await router.choose_replicas([a, b, c], pending(Req(toks(7, 8, 9))))
        assert ranks[0][0].replica_id != home.replica_id
        for pr in burst:
            router.on_request_routed(pr, home.replica_id, None)
        assert router._load(home) == 3  # now in flight instead
        stats = router.router_stats()
        # The prediction is what was believed before the request itself was recorded.
        assert stats["routed_without_match"] == 1 and stats["routed_with_match"] == 2
        assert stats["predicted_matched_tokens"] == 2 * 6 * 4
    asyncio.run(scenario())


def test_router_withdraws_a_pick_serve_did_not_take():
    async def scenario():
        clock = [1000.0]
        router = make_router(clock)
        a, b = FakeReplica("a"), FakeReplica("b")
        router.update_replicas([a, b])
        prompt = toks(1, 2, 3)
        pr = pending(Req(prompt))
        ranks = await router.choose_replicas([a, b], pr)
        picked, other = ranks[0][0], ranks[1][0]
        router.on_request_routed(pr, other.replica_id, None)  # e.g. the pick was full
        h = router._index.hashes(prompt)
        assert router._index.match(h) == {picked.replica_id: 0, other.replica_id: 3}
        assert router._load(picked) == 0 and router._load(other) == 1
        # A chosen request that never gets routed (cancelled) stops counting as load.
        lost = pending(Req(toks(5)))
        ranks = await router.choose_replicas([a, b], lost)
        assert router._load(ranks[0][0]) == 1
        clock[0] += 10
        assert router._load(ranks[0][0]) == 0
    asyncio.run(scenario())


# ---------------------------------------------------------------------------------------
# Replicas joining and leaving (autoscaling; tests/test_autoscaling.py runs it for real)
# ---------------------------------------------------------------------------------------

def test_router_new_replica_takes_load_until_balanced_then_affinity_shares():
    """A replica that joins empty while its peer holds the hot prefix gets requests by load
    (not starved by its empty index), but only until loads are balanced (not flooded)."""
    async def scenario():
        router = make_router()  # abs_threshold 4
        a = FakeReplica("a")
        router.update_replicas([a])
        prefix = toks(1, 2, 3, 4)
        for i in range(6):  # six requests of the prefix in flight on a
            router.on_request_routed(pending(Req(prefix + toks(20 + i))), a.replica_id, None)
        b = FakeReplica("b")
        router.update_replicas([a, b])  # scaled out
        picks = []
        for i in range(8):
            _, chosen = await route(router, [a, b], pending(Req(prefix + toks(40 + i))))
            picks.append(chosen.replica_id.unique_id)
            loads = router._load(a), router._load(b)
            assert loads[1] <= loads[0] + 1, (picks, loads)  # never flooded past its peer
        # 6 vs 0, 6 vs 1: imbalanced -> b; then b holds the prefix too and the tie on
        # matched blocks goes to the less loaded, until both carry 6; then they share.
        assert picks[:6] == ["b"] * 6 and "a" in picks[6:], picks
        assert abs(router._load(a) - router._load(b)) <= 1
        assert router.router_stats()["load_fallbacks"] == 2
    asyncio.run(scenario())


def test_router_empty_new_replica_does_not_take_a_cached_prefix_below_the_threshold():
    async def scenario():
        router = make_router()
        a, b = FakeReplica("a"), FakeReplica("b")
        router.update_replicas([a])
        prefix = toks(1, 2, 3, 4)
        for i in range(3):
            router.on_request_routed(pending(Req(prefix + toks(20 + i))), a.replica_id, None)
        router.update_replicas([a, b])
        # 3 vs 0 is within abs_threshold 4: the cache hit is worth more than the idle peer.
        ranks, _ = await route(router, [a, b], pending(Req(prefix)))
        assert ranks == [["a"], ["b"]]
        # A prompt nobody holds goes to the idle newcomer.
        ranks, _ = await route(router, [a, b], pending(Req(toks(7, 8))))
        assert ranks[0] == ["b"]
    asyncio.run(scenario())


def test_router_join_leave_sequence_forgets_everything_of_removed_replicas():
    async def scenario():
        clock = [1000.0]
        router = make_router(clock, digest_grace_s=0.0)
        a, b = FakeReplica("a"), FakeReplica("b")
        router.update_replicas([a, b])
        prefix = toks(1, 2, 3)
        on_b = pending(Req(prefix))
        router.on_request_routed(on_b, b.replica_id, None)  # in flight on b
        c, d = FakeReplica("c"), FakeReplica("d")
        router.update_replicas([a, b, c])
        router.update_replicas([a, b, c, d])
        assert router.router_stats()["replicas_tracked"] == 4
        # A pick for c that Serve has not sent yet, then c and b go (scale-in; c's actor
        # dies, b is removed by an update).
        chosen_for_c = pending(Req(toks(9, 9)))
        await router.choose_replicas([c], chosen_for_c)
        assert router._load(c) == 1
        router.on_replica_actor_died(c.replica_id)
        router.update_replicas([a, d])
        assert set(router._index.replicas()) == {a.replica_id, d.replica_id}
        assert router._load(b) == 0 and router._load(c) == 0
        assert b.replica_id not in router._in_flight and not router._tentative
        # b's request completes after b left: nothing goes negative or comes back.
        router.on_request_completed(b.replica_id, on_b.metadata.internal_request_id)
        assert set(router._index.replicas()) == {a.replica_id, d.replica_id}
        # b's prefix is now nowhere: a fresh prompt goes by load among the survivors.
        ranks, _ = await route(router, [a, d], pending(Req(prefix)))
        assert {r for rank in ranks for r in rank} == {"a", "d"}
        assert router.router_stats()["replicas_tracked"] == 2
        # A late digest from the removed b (stats broadcast racing the removal) is not
        # merged: only replicas in the update are read.
        truth = CacheDigest(block_size=4, clock=lambda: clock[0])
        truth.insert(toks(5, 6))
        b.routing_stats = {"cache_digest": truth.encode()}
        router.update_replicas([a, d])
        assert b.replica_id not in router._index.replicas()
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
