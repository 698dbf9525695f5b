"""Unit tests of the prefix-aware router's building blocks: hashing, index, replica digest
(the policy and the Serve RequestRouter: tests/test_router_rendezvous.py)."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.cache_digest import CacheDigest, Digest, decode_digest
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
