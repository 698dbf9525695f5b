"""RadixCache invariants under random operation sequences, and its unit behaviour."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.slot_allocator import SlotAllocator
from engine.core.radix_cache import RadixCache, TreeNode


def make_cache(slots: int = 64, events: bool = False) -> RadixCache:
    return RadixCache(SlotAllocator(slots), record_events=events)


def cached_insert(cache: RadixCache, tokens: list[int]) -> None:
    """What a finishing request does: match, allocate the rest, insert, free duplicates."""
    matched, _ = cache.match_prefix(tokens)
    need = len(tokens) - len(matched)
    if cache.allocator.num_free < need:
        cache.evict(need - cache.allocator.num_free)
    new = cache.allocator.alloc(need)
    assert new is not None
    slots = matched + new
    already = cache.insert(tokens, slots)
    cache.allocator.free(slots[len(matched):already])


def check_invariants(cache: RadixCache) -> None:
    in_tree = cache.all_slots()
    free = cache.allocator.free_slots()
    assert len(set(in_tree)) == len(in_tree), "a slot is held twice by the tree"
    assert not set(in_tree) & set(free), "a slot is both free and in the tree"
    assert len(set(free)) == len(free), "a slot is free twice"
    assert len(in_tree) == cache.total_size
    _check_node(cache.root, cache)


def _check_node(node: TreeNode, cache: RadixCache) -> int:
    locks_below = 0
    for first, child in node.children.items():
        assert child.key and child.key[0] == first and child.parent is node
        assert len(child.key) == len(child.value)
        locks_below = max(locks_below, _check_node(child, cache))
    if node is not cache.root:
        assert node.lock_ref >= locks_below, "a locked node's ancestor is unlocked"
    return node.lock_ref


def test_match_insert_split():
    cache = make_cache()
    cached_insert(cache, [1, 2, 3, 4, 5])
    slots, node = cache.match_prefix([1, 2, 3, 9])
    assert len(slots) == 3 and node.key == (1, 2, 3)
    cached_insert(cache, [1, 2, 3, 9, 9])
    assert sorted(cache.root.children[1].children) == [4, 9]
    full, _ = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert len(full) == 5
    check_invariants(cache)


def test_locked_nodes_survive_eviction_and_lru_order():
    cache = make_cache(slots=12)
    cached_insert(cache, [1, 1, 1, 1])
    cached_insert(cache, [2, 2, 2, 2])
    cached_insert(cache, [3, 3, 3, 3])
    _, node1 = cache.match_prefix([1, 1, 1, 1])
    cache.lock(node1)
    cache.match_prefix([3, 3])  # touch 3: 2 is now the least recently used
    assert cache.evict(1) == 4
    assert cache.match_prefix([2, 2])[0] == []
    assert cache.evict(100) == 2 + 2  # the 3-prefix (split in two nodes); 1 is locked
    assert len(cache.match_prefix([1, 1, 1, 1])[0]) == 4
    cache.unlock(node1)
    assert cache.evict(100) == 4 and cache.allocator.num_free == 12


def test_events_describe_full_prefixes():
    cache = make_cache(events=True)
    cached_insert(cache, [1, 2, 3])
    cached_insert(cache, [1, 2, 4, 5])
    cache.evict(100)
    kinds = [(e.kind, e.tokens, e.start) for e in cache.drain_events()]
    assert kinds[:2] == [("insert", (1, 2, 3), 0), ("insert", (1, 2, 4, 5), 2)]
    assert {k[1:] for k in kinds[2:]} == {((1, 2, 3), 2), ((1, 2, 4, 5), 2), ((1, 2), 0)}


def test_disabled_cache_matches_nothing():
    cache = RadixCache(SlotAllocator(8), enabled=False)
    assert cache.insert([1, 2], [1, 2]) == 0
    assert cache.match_prefix([1, 2]) == ([], cache.root)


ops = st.lists(st.tuples(st.sampled_from(["insert", "lock", "unlock", "evict"]),
                         st.lists(st.integers(0, 3), min_size=1, max_size=12),
                         st.integers(0, 30)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_operations_keep_invariants(operations):
    cache = make_cache(slots=48)
    locked: list[TreeNode] = []
    for op, tokens, n in operations:
        if op == "insert":
            matched, _ = cache.match_prefix(tokens)
            if len(tokens) - len(matched) <= cache.allocator.num_free + cache.evictable_size:
                cached_insert(cache, tokens)
        elif op == "lock":
            _, node = cache.match_prefix(tokens)
            cache.lock(node)
            locked.append(node)
        elif op == "unlock" and locked:
            cache.unlock(locked.pop(n % len(locked)))
        elif op == "evict":
            protected = {id(x) for node in locked for x in _path(node)}
            before = {id(x): x for x in _all_nodes(cache)}
            cache.evict(n)
            after = {id(x) for x in _all_nodes(cache)}
            assert protected <= after, "a locked node was evicted"
            assert set(before) >= after
        check_invariants(cache)
    for node in locked:
        cache.unlock(node)
    cache.evict(10**6)
    assert cache.allocator.num_free == 48, "slots leaked"
    assert cache.total_size == 0


def _path(node: TreeNode) -> list[TreeNode]:
    out = []
    while node is not None and node.parent is not None:
        out.append(node)
        node = node.parent
    return out


def _all_nodes(cache: RadixCache) -> list[TreeNode]:
    out, stack = [], [cache.root]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


class DictModel:
    """What the tree should hold, without a tree: cached prefix (a tuple) -> its last
    token's slot. Matching walks prefixes one token at a time."""

    def __init__(self) -> None:
        self.slots: dict[tuple[int, ...], int] = {}

    def match(self, tokens: list[int]) -> list[int]:
        out = []
        for i in range(len(tokens)):
            slot = self.slots.get(tuple(tokens[:i + 1]))
            if slot is None:
                break
            out.append(slot)
        return out

    def insert(self, tokens: list[int], slots: list[int]) -> int:
        """Like RadixCache.insert: keeps its own slots for the cached leading tokens."""
        already = len(self.match(tokens))
        for i in range(already, len(tokens)):
            self.slots[tuple(tokens[:i + 1])] = slots[i]
        return already

    def drop_freed(self, freed: set[int]) -> int:
        """Forget the prefixes whose slots the tree freed; returns how many."""
        gone = [p for p, s in self.slots.items() if s in freed]
        for p in gone:
            del self.slots[p]
        return len(gone)


@pytest.mark.parametrize("seed", range(6))
def test_matches_agree_with_a_dictionary_model(seed):
    """Random inserts (sharing prefixes, so nodes split), matches, locks and evictions:
    every match returns the slots inserted for those tokens, insert reports the cached
    length, eviction frees whole subtrees (what stays is prefix-closed) and never a locked
    path, and the tree holds exactly the model's slots."""
    rng = random.Random(seed)
    cache = make_cache(slots=40)
    model = DictModel()
    locked: list[tuple[TreeNode, tuple[int, ...]]] = []  # node, its full prefix

    def evict(n: int) -> int:
        before = set(cache.allocator.free_slots())
        freed = cache.evict(n)
        gone = set(cache.allocator.free_slots()) - before
        assert len(gone) == freed == model.drop_freed(gone)
        return freed

    def tokens() -> list[int]:
        # small alphabet and a common stem: many shared prefixes, splits at any depth
        stem = [1, 2, 3, 1, 2][:rng.randint(0, 5)]
        return stem + [rng.randint(0, 3) for _ in range(rng.randint(1, 8))]

    for _ in range(300):
        op = rng.random()
        toks = tokens()
        if op < 0.45:  # a request finishing: match and lock, allocate the rest, insert
            matched, node = cache.match_prefix(toks)
            assert matched == model.match(toks)
            cache.lock(node)
            need = len(toks) - len(matched)
            if cache.allocator.num_free < need:
                evict(need - cache.allocator.num_free)
            new = cache.allocator.alloc(need)
            if new is not None:
                slots = matched + new
                already = cache.insert(toks, slots)
                assert already == model.insert(toks, slots) == len(matched)
                cache.allocator.free(slots[len(matched):already])
            cache.unlock(node)
        elif op < 0.65:
            assert cache.match_prefix(toks)[0] == model.match(toks)
        elif op < 0.78:
            matched, node = cache.match_prefix(toks)
            cache.lock(node)
            locked.append((node, tuple(toks[:len(matched)])))
        elif op < 0.88 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked)))[0])
        else:
            n = rng.randint(1, 12)
            if evict(n) < n:  # short: nothing evictable is left
                assert cache.evictable_size == 0
        for _, prefix in locked:  # locked paths survive
            assert all(prefix[:i + 1] in model.slots for i in range(len(prefix)))
        assert all(p[:-1] in model.slots for p in model.slots if len(p) > 1), "not prefix-closed"
        assert sorted(cache.all_slots()) == sorted(model.slots.values())
        assert cache.total_size == len(model.slots)
        check_invariants(cache)
    for node, _ in locked:
        cache.unlock(node)
    evict(10**6)
    assert not model.slots and cache.allocator.num_free == 40


def test_tree_and_free_list_stay_out_of_the_garbage_collector():
    """A full tree holds the whole pool's tokens: its keys and slots, and the allocator's free
    list, must not be containers the collector walks at every full collection."""
    import gc

    cache = make_cache(slots=4096)
    assert len(gc.get_referents(cache.allocator._free)) <= 1  # (its type) not 4,096 ints
    tokens = list(range(3000))
    cached_insert(cache, tokens)
    cached_insert(cache, tokens[:1000] + [7] * 500)  # splits the first node
    gc.collect()
    nodes, stack = [], [cache.root]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
    assert len(nodes) == 4
    assert not any(gc.is_tracked(n.key) or gc.is_tracked(n.value) for n in nodes)
    assert cache.match_prefix(tokens[:2000])[0] == cache.match_prefix(tokens)[0][:2000]
