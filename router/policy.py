"""The routing decision as a pure function: prefix affinity unless load says otherwise.

Inputs per candidate: how many leading blocks of the request it is believed to hold, its
load (ongoing requests: running + waiting) and its KV-cache usage fraction. Output: the
candidates' ids in ranks, best first, the shape Serve's `choose_replicas` returns (Serve
picks the replica with the shortest queue inside a rank, and moves to the next rank when
every replica of a rank is full).

Rules, in the spirit of sgl-router's cache-aware policy:
1. A replica whose KV usage is above `kv_high_water` counts as loaded: it would have to
   evict to take more, so it only appears in the last rank (unless every replica is).
2. Load is imbalanced when max - min > `abs_threshold` AND max > `rel_threshold` * min.
   Then the least loaded replica wins, whatever it caches (LOAD_FALLBACK).
3. Otherwise the longest match wins, ties broken by load (AFFINITY), provided it covers at
   least `min_match_ratio` of the request's blocks: a tiny shared prefix is not worth
   piling onto one replica.
4. Without a worthwhile match the least loaded replica wins (NO_MATCH), or LOAD_FALLBACK
   when the only worthwhile match sits on a replica excluded by rule 1.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from enum import Enum


class Decision(str, Enum):
    AFFINITY = "affinity"
    NO_MATCH = "no_match"
    LOAD_FALLBACK = "load_fallback"


@dataclass(frozen=True)
class Candidate:
    replica_id: Hashable
    matched_blocks: int = 0
    load: float = 0  # ongoing requests (running + waiting)
    kv_usage: float = 0.0  # fraction of the KV pool in use, 0..1


@dataclass(frozen=True)
class PolicyConfig:
    abs_threshold: float = 16  # requests
    rel_threshold: float = 1.5
    min_match_ratio: float = 0.1
    kv_high_water: float = 0.95

    def __post_init__(self) -> None:
        if self.abs_threshold < 0:
            raise ValueError("abs_threshold must be >= 0")
        if self.rel_threshold < 1.0:
            raise ValueError("rel_threshold must be >= 1")
        if not 0.0 <= self.min_match_ratio <= 1.0:
            raise ValueError("min_match_ratio must be in [0, 1]")
        if self.kv_high_water <= 0.0:
            raise ValueError("kv_high_water must be > 0")


@dataclass(frozen=True)
class Choice:
    ranks: list[list[Hashable]]  # best first; every candidate appears exactly once
    decision: Decision
    matched_blocks: int  # believed match of the first-ranked replica


def is_imbalanced(loads: Sequence[float], config: PolicyConfig) -> bool:
    if not loads:
        return False
    hi, lo = max(loads), min(loads)
    return hi - lo > config.abs_threshold and hi > config.rel_threshold * lo


def worthwhile(matched_blocks: int, request_blocks: int, config: PolicyConfig) -> bool:
    """Is a match long enough to steer the request by it?"""
    if matched_blocks <= 0 or request_blocks <= 0:
        return False
    return matched_blocks / request_blocks >= config.min_match_ratio


def choose(
    request_blocks: int,
    candidates: Sequence[Candidate],
    config: PolicyConfig = PolicyConfig(),
) -> Choice:
    """Rank `candidates` for a request of `request_blocks` full blocks."""
    if not candidates:
        return Choice(ranks=[], decision=Decision.NO_MATCH, matched_blocks=0)

    cool = [c for c in candidates if c.kv_usage <= config.kv_high_water]
    hot = [c for c in candidates if c.kv_usage > config.kv_high_water]
    pool, spill = (cool, hot) if cool else (hot, [])
    pool = _by_load(pool)

    if is_imbalanced([c.load for c in pool], config):
        first, decision = _least_loaded(pool), Decision.LOAD_FALLBACK
    else:
        best = max(c.matched_blocks for c in pool)
        if worthwhile(best, request_blocks, config):
            first = [c for c in pool if c.matched_blocks == best]
            decision = Decision.AFFINITY
        else:
            first = _least_loaded(pool)
            spilled_best = max((c.matched_blocks for c in spill), default=0)
            decision = (Decision.LOAD_FALLBACK
                        if worthwhile(spilled_best, request_blocks, config)
                        else Decision.NO_MATCH)

    chosen = {id(c) for c in first}
    rest = [c for c in pool if id(c) not in chosen]
    ranks = [[c.replica_id for c in group] for group in (first, rest, _by_load(spill)) if group]
    return Choice(ranks=ranks, decision=decision, matched_blocks=first[0].matched_blocks)


def _by_load(candidates: Sequence[Candidate]) -> list[Candidate]:
    # Stable sort: equal candidates keep the caller's order, so results are reproducible.
    return sorted(candidates, key=lambda c: (c.load, c.kv_usage))


def _least_loaded(pool_by_load: list[Candidate]) -> list[Candidate]:
    """All candidates sharing the minimum load (Serve picks among them by queue length)."""
    lowest = pool_by_load[0].load
    return [c for c in pool_by_load if c.load == lowest]
