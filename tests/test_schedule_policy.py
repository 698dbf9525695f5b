"""schedule_policy: "lpm" (longest prefix match first) against "fcfs" on the radix hit
rate, and its bound against starvation."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.core.admission import AdmissionOrder
from engine.core.slot_allocator import SlotAllocator
from engine.core.radix_cache import RadixCache
from engine.core.request import Request


def interleaved_groups(groups: int = 3, per_group: int = 4, prefix: int = 120) -> list[list[int]]:
    """Prompts of `groups` long shared prefixes, arriving interleaved (A B C A B C ...)."""
    prefixes = [[(37 * g + 11 * i) % 690 + 5 for i in range(prefix)] for g in range(groups)]
    return [prefixes[g] + [600 + 7 * k + g, 3 + k, 4 + g, 5]
            for k in range(per_group) for g in range(groups)]


def test_lpm_raises_the_hit_rate_when_the_pool_holds_few_prefixes(tiny_llama):
    """One request at a time in a pool with room for about two prefixes: fcfs alternates
    the groups and LRU eviction drops each prefix before its group comes back; lpm runs a
    group's requests back to back while its prefix is cached. Outputs are the same."""
    prompts = interleaved_groups()
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    outs, rates = {}, {}
    for policy in ("fcfs", "lpm"):
        llm = LLM(model=tiny_llama, dtype="float32", max_total_tokens=300, max_running_requests=1,
                  schedule_policy=policy)
        outs[policy] = [o.token_ids for o in llm.generate(prompts, params)]
        rates[policy] = llm.stats()["cache_hit_rate"]
    assert outs["lpm"] == outs["fcfs"]
    assert rates["fcfs"] < 0.1, rates
    assert rates["lpm"] > 0.6, rates  # 3 groups x 3 hits of 120 tokens / 12 x 124 = 0.73


class _PrefixCache:
    """match_len: the prompt's length for 'hot' requests (token 1 first), else 0."""

    enabled = True

    @staticmethod
    def match_len(tokens: list[int], namespace: int = 0) -> int:
        return len(tokens) if tokens[0] == 1 else 0


def test_lpm_bounds_how_long_a_request_is_passed_over():
    """A cold request first in the queue while hot ones keep arriving: lpm passes it over
    `max_wait` times, then admits it first."""
    order = AdmissionOrder("lpm", _PrefixCache(), max_wait=5)
    cold = Request("cold", [2, 3], SamplingParams())
    queue = [cold] + [Request(f"hot{i}", [1, 2], SamplingParams()) for i in range(3)]
    admitted, n = [], 3
    while cold not in admitted:
        first = order(queue)[0]
        admitted.append(first)
        queue.remove(first)
        n += 1
        queue.append(Request(f"hot{n}", [1, 2], SamplingParams()))
    assert len(admitted) == 6 and admitted[-1] is cold


def test_fcfs_keeps_queue_order_and_unknown_policies_fail():
    queue = [Request(f"r{i}", [i + 1], SamplingParams()) for i in range(4)]
    assert AdmissionOrder("fcfs", _PrefixCache())(queue) == queue
    with pytest.raises(ValueError, match="schedule_policy"):
        AdmissionOrder("sjf", _PrefixCache())


def test_match_len_reads_the_tree_without_changing_it():
    cache = RadixCache(SlotAllocator(64))
    cache.insert([1, 2, 3, 4, 5, 6], cache.allocator.alloc(6))
    assert cache.match_len([1, 2, 3, 9]) == 3
    assert cache.match_len([1, 2, 3, 4, 5, 6, 7]) == 6
    assert cache.match_len([7, 1]) == 0
    assert [len(c.key) for c in cache.root.children.values()] == [6]  # no split
