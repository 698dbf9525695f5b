"""The radix cache over a host tier (engine/core/host_tier.py, engine/executor/kv_transfer.py)
without a model: real CPU KV pools whose rows hold a value derived from each token's
prefix, so every move between the tiers is checked byte for byte; eviction and reload
order; and a property test of random operation streams (no device or host slot leaks,
host memory within its size, the tree's shape, the routing digest's blocks and which of
them are on the host only)."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.attention.kv_pool import KVPool
from engine.core.host_tier import HostTier
from engine.core.radix_cache import RadixCache, TreeNode
from engine.executor.kv_transfer import KVTransfer
from router.cache_digest import CacheDigest, decode_digest
from router.hashing import block_hashes

LAYERS, HEADS, DIM = 2, 1, 4


class Tiered:
    """A device pool, a host tier and the tree over both."""

    def __init__(self, device_slots: int, host_slots: int, eager: bool = False) -> None:
        self.pool = KVPool(device_slots, LAYERS, HEADS, DIM, torch.float32, "cpu")
        self.transfer = KVTransfer(self.pool, host_slots)
        self.tier = HostTier(host_slots, self.transfer, eager=eager)
        self.cache = RadixCache(self.pool.allocator, host=self.tier, record_events=True)
        self.digest = CacheDigest(block_size=2)  # what a router learns from the events

    def finish(self, tokens: list[int]) -> bool:
        """What a request does: load its prefix back, compute the rest, insert. False when
        the pool cannot hold it."""
        cache, alloc = self.cache, self.pool.allocator
        cache.load_back(tokens)
        matched, node = cache.match_prefix(tokens)
        need = len(tokens) - len(matched)
        cache.lock(node)
        if alloc.num_free + cache.evictable_size < need:
            cache.unlock(node)
            return False
        if alloc.num_free < need:
            cache.evict(need - alloc.num_free)
        new = alloc.alloc(need)
        for i, slot in enumerate(new, start=len(matched)):
            self.write(slot, tokens[:i + 1])
        already = cache.insert(tokens, matched + new)
        alloc.free(new[:max(0, already - len(matched))])
        cache.unlock(node)
        return True

    def write(self, slot: int, prefix: list[int]) -> None:
        for layer in range(LAYERS):
            self.pool.k[layer][slot] = expected(prefix, layer, 0)
            self.pool.v[layer][slot] = expected(prefix, layer, 1)


def expected(prefix: list[int] | tuple[int, ...], layer: int, kv: int) -> torch.Tensor:
    h = hash((tuple(prefix), layer, kv)) % 100_003
    return torch.arange(DIM, dtype=torch.float32).view(HEADS, DIM) + h


def check(t: Tiered) -> None:
    cache, tier = t.cache, t.tier
    t.digest.apply_all(cache.drain_events())
    assert set(t.digest.hashes()) == held_blocks(cache.root, ()), \
        "the events do not say what the tree holds (in either tier)"
    assert decode_digest(t.digest.encode()).host_hashes == host_only_blocks(cache.root, ()), \
        "the events do not say which blocks are on the host only"
    device = cache.all_slots()
    assert sorted(device + cache.allocator.free_slots()) == list(range(1, t.pool.num_slots + 1)), \
        "a device slot leaked or is held twice"
    host = cache.all_host_slots()
    assert sorted(host + tier.free_slots()) == list(range(1, tier.num_slots + 1)), \
        "a host slot leaked or is held twice"
    assert tier.used_slots == len(host) <= tier.num_slots
    assert len(device) == cache.total_size
    _check_node(t, cache.root, ())


def held_blocks(node: TreeNode, path: tuple[int, ...]) -> set[int]:
    out = set(block_hashes(path, 2)) if path else set()
    for child in node.children.values():
        out |= held_blocks(child, path + child.key)
    return out


def host_only_blocks(node: TreeNode, path: tuple[int, ...]) -> set[int]:
    """The blocks that end in a host-only node (each block belongs to the node holding its
    last token)."""
    out: set[int] = set()
    for child in node.children.values():
        full = path + child.key
        if not child.value:
            out |= set(block_hashes(full, 2)[len(path) // 2:])
        out |= host_only_blocks(child, full)
    return out


def _check_node(t: Tiered, node: TreeNode, path: tuple[int, ...]) -> None:
    for first, child in node.children.items():
        assert child.key[0] == first and child.parent is node
        assert child.value or child.host_value is not None, "a node with its KV nowhere"
        if child.value:
            assert node is t.cache.root or node.value, "a device node under a host-only one"
            assert len(child.value) == len(child.key)
        if child.host_value is not None:
            assert len(child.host_value) == len(child.key)
        full = path + child.key
        for i in range(len(child.key)):
            prefix = full[:len(path) + i + 1]
            for layer in range(LAYERS):
                want = expected(prefix, layer, 0)
                if child.value:
                    assert torch.equal(t.pool.k[layer][child.value[i]], want)
                if child.host_value is not None:
                    assert torch.equal(t.transfer.host_pool.k[layer][child.host_value[i]], want)
        _check_node(t, child, full)


def on_host_only(cache: RadixCache, tokens: list[int]) -> bool:
    node = cache.root.children.get(tokens[0])
    return node is not None and not node.value and node.host_value is not None


def test_eviction_moves_the_oldest_to_the_host_and_a_reload_brings_it_back():
    t = Tiered(device_slots=8, host_slots=8)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    assert t.finish(a) and t.finish(b) and t.finish(c)  # c evicts a, the least recent
    assert on_host_only(t.cache, a) and not on_host_only(t.cache, b)
    assert t.cache.match_prefix(a)[0] == [] and t.cache.match_len(a) == 0
    check(t)
    assert t.cache.load_back(a + [99]) == 4  # b is now the oldest: it goes to the host
    assert len(t.cache.match_prefix(a)[0]) == 4
    assert on_host_only(t.cache, b) and not on_host_only(t.cache, c)
    check(t)
    assert t.tier.stats.written_tokens == 8 and t.tier.stats.loaded_tokens == 4
    # a went out and came back: evicting it again frees its slots without another copy
    t.cache.evict(8)
    assert t.tier.stats.written_tokens == 12  # c's 4; a kept its host copy
    check(t)


def test_a_full_host_tier_drops_its_least_recent_copies_leaves_first():
    t = Tiered(device_slots=4, host_slots=6)
    t.finish([1, 2, 3, 4])
    t.finish([1, 2, 5, 6])  # [1, 2] splits off; [3, 4] goes to the host
    t.finish([7, 8, 9, 10])  # [1, 2] and [5, 6] follow: the host is full
    check(t)
    assert t.tier.used_slots == 6 and t.tier.stats.dropped_tokens == 0
    t.finish([11, 12, 13, 14])  # [7..10] needs 4 host slots: the two old leaves go
    check(t)
    parent = t.cache.root.children[1]
    assert parent.key == (1, 2) and not parent.children and parent.host_value is not None
    assert on_host_only(t.cache, [7]) and t.tier.stats.dropped_tokens == 4


def test_a_partial_match_on_the_host_loads_only_what_is_needed():
    t = Tiered(device_slots=8, host_slots=16)
    t.finish([1, 2, 3, 4, 5, 6])
    t.cache.evict(6)
    assert t.cache.load_back([1, 2, 3, 9]) == 3
    assert len(t.cache.match_prefix([1, 2, 3, 4])[0]) == 3
    check(t)


def test_a_recomputed_host_node_takes_the_new_slots_as_its_device_copy():
    """A prefix on the host that a request computed again (it was admitted without the
    load) gets the request's slots; the count of already-cached tokens stops before it."""
    t = Tiered(device_slots=8, host_slots=16)
    t.finish([1, 2, 3, 4])
    t.cache.evict(4)
    slots = t.pool.allocator.alloc(6)
    for i, s in enumerate(slots):
        t.write(s, [1, 2, 3, 4, 5, 6][:i + 1])
    assert t.cache.insert([1, 2, 3, 4, 5, 6], slots) == 0
    assert t.cache.match_prefix([1, 2, 3, 4, 5, 6])[0] == slots
    check(t)


def test_prefetch_never_evicts_and_reset_empties_both_tiers():
    t = Tiered(device_slots=8, host_slots=16, eager=True)
    t.finish([1, 2, 3, 4])
    t.finish([5, 6, 7, 8])
    assert t.tier.stats.written_tokens == 8  # eager: copied as they entered the tree
    t.finish([9, 10, 11, 12])
    assert t.tier.stats.written_tokens == 12
    assert on_host_only(t.cache, [1])
    assert t.cache.load_back([1, 2, 3, 4], free_only=True) == 0  # no free slot
    t.cache.evict(4)
    assert t.cache.load_back([1, 2, 3, 4], free_only=True) == 4
    check(t)
    t.cache.reset()
    assert not t.cache.root.children and t.tier.used_slots == 0
    check(t)


OPS = st.lists(st.one_of(
    st.tuples(st.just("finish"), st.lists(st.integers(0, 3), min_size=1, max_size=10)),
    st.tuples(st.just("hold"), st.lists(st.integers(0, 3), min_size=1, max_size=10)),
    st.tuples(st.just("prefetch"), st.lists(st.integers(0, 3), min_size=1, max_size=10)),
    st.tuples(st.just("release"), st.integers(0, 7)),
    st.tuples(st.just("evict"), st.integers(1, 12)),
    st.tuples(st.just("reset"), st.none()),
), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, eager=st.booleans(), host_slots=st.integers(1, 24))
def test_random_streams_leak_nothing_and_keep_the_bytes(ops, eager, host_slots):
    t = Tiered(device_slots=16, host_slots=host_slots, eager=eager)
    held: list[TreeNode] = []
    for op, arg in ops:
        if op == "finish":
            t.finish(arg)
        elif op == "hold":  # a running request keeps its cached prefix locked
            t.cache.load_back(arg)
            _, node = t.cache.match_prefix(arg)
            t.cache.lock(node)
            held.append(node)
        elif op == "prefetch":
            t.cache.load_back(arg, free_only=True)
        elif op == "release" and held:
            t.cache.unlock(held.pop(arg % len(held)))
        elif op == "evict":
            t.cache.evict(arg)
        elif op == "reset":
            t.cache.reset()
        check(t)
    for node in held:
        t.cache.unlock(node)
    t.cache.reset()
    check(t)
    assert t.cache.total_size == 0 and t.tier.used_slots == 0
