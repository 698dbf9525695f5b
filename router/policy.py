"""The routing decision as a pure function of what every ingress sees alike.

Inputs: the candidates in the prefix's own rendezvous order (`router.rendezvous`), each with
how many leading blocks of the request its last cache digest holds (and how many of those
are on its host tier only), its load and its KV usage. Output: one replica per rank, best first (Serve sends to the first rank unless that
replica is full, then tries the next).

Rules:
1. Digest correction: a replica whose digest holds a worthwhile number of blocks *more*
   than the prefix's first choice (at least `min_match_ratio` of the request, and one
   block) moves ahead of it, longest match first; equal matches keep the rendezvous order,
   so a prefix cached on two replicas does not flap between them. A block on the host tier
   only counts `host_weight` of one on the GPU (router/fetch_cost.py: the compute its load
   saves), so a host holder ranks above a replica holding nothing and below a GPU holder.
2. A replica whose KV usage is above `kv_high_water` would have to evict to take more: it
   moves to the back (unless every replica is that full).
3. Bounded load: with fair = (total load + 1) / replicas, a replica is past its bound when
   its load + 1 exceeds both fair + `abs_threshold` and `rel_threshold` * fair. The first
   replica in the order that is not past its bound wins (OVERFLOW when that is not the
   first); when all are, the least loaded (LOAD_FALLBACK).
Every input is shared (rendezvous scores, digests, the replicas' reported load), so router
instances that saw different traffic decide alike; see docs/architecture.md.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from enum import Enum

from router.adapter_affinity import AdapterTier, by_adapter_tier
from router.fetch_cost import FetchCosts, host_weight


class Decision(str, Enum):
    AFFINITY = "affinity"  # the first choice, holding a worthwhile match
    NO_MATCH = "no_match"  # the first choice, holding nothing worth steering by
    OVERFLOW = "overflow"  # the first choice was past its bound: a later one in the order
    LOAD_FALLBACK = "load_fallback"  # every replica past its bound: the least loaded


@dataclass(frozen=True)
class Candidate:
    replica_id: Hashable
    matched_blocks: int = 0
    load: float = 0  # ongoing requests (running + waiting)
    kv_usage: float = 0.0  # fraction of the KV pool in use, 0..1
    adapter_tier: int = AdapterTier.IN_GPU  # where it holds the request's LoRA adapter
    host_blocks: int = 0  # of `matched_blocks`, those on its host tier only


@dataclass(frozen=True)
class PolicyConfig:
    abs_threshold: float = 16  # requests over the fair share before a replica overflows
    rel_threshold: float = 1.5  # ... and times the fair share
    min_match_ratio: float = 0.1
    kv_high_water: float = 0.95
    host_weight: float = host_weight(FetchCosts())  # a host-tier block against a GPU one

    def __post_init__(self) -> None:
        if self.abs_threshold < 0:
            raise ValueError("abs_threshold must be >= 0")
        if self.rel_threshold < 1.0:
            raise ValueError("rel_threshold must be >= 1")
        if not 0.0 <= self.min_match_ratio <= 1.0:
            raise ValueError("min_match_ratio must be in [0, 1]")
        if self.kv_high_water <= 0.0:
            raise ValueError("kv_high_water must be > 0")
        if not 0.0 <= self.host_weight <= 1.0:
            raise ValueError("host_weight must be in [0, 1]")


@dataclass(frozen=True)
class Choice:
    ranks: list[list[Hashable]]  # one replica per rank, best first; each candidate once
    decision: Decision
    matched_blocks: int  # digest match of the chosen replica
    corrected: bool = False  # a digest moved another replica ahead of the first choice


def held(c: Candidate, config: PolicyConfig) -> float:
    """The candidate's match in GPU blocks' worth."""
    return c.matched_blocks - c.host_blocks * (1.0 - config.host_weight)


def worthwhile(matched_blocks: float, request_blocks: int, config: PolicyConfig) -> bool:
    """Is a match (or a difference of matches) long enough to steer the request by it?"""
    if matched_blocks <= 0 or request_blocks <= 0:
        return False
    return matched_blocks / request_blocks >= config.min_match_ratio


def past_bound(load: float, fair: float, config: PolicyConfig) -> bool:
    return load + 1 > fair + config.abs_threshold and load + 1 > config.rel_threshold * fair


def corrected_order(request_blocks: int, ranked: Sequence[Candidate],
                    config: PolicyConfig) -> list[Candidate]:
    """Rule 1: replicas holding worthwhile more than the first choice go ahead of it."""
    home = held(ranked[0], config)
    ahead = [c for c in ranked if worthwhile(held(c, config) - home, request_blocks, config)]
    ahead.sort(key=lambda c: -held(c, config))  # stable: rendezvous order among equals
    moved = {id(c) for c in ahead}
    return ahead + [c for c in ranked if id(c) not in moved]


def choose(request_blocks: int, ranked: Sequence[Candidate],
           config: PolicyConfig = PolicyConfig()) -> Choice:
    """Rank `ranked` (the prefix's rendezvous order) for a request of `request_blocks`."""
    if not ranked:
        return Choice(ranks=[], decision=Decision.NO_MATCH, matched_blocks=0)
    # Rule 0: a request for a LoRA adapter goes first to the replicas holding it in their
    # GPU pool, then in host memory (router/adapter_affinity.py); the prefix's order stands
    # within each tier.
    ranked = by_adapter_tier(ranked)
    order = corrected_order(request_blocks, ranked, config)
    corrected = order[0] is not ranked[0]
    first = order[0]
    cool = [c for c in order if c.kv_usage <= config.kv_high_water]
    if cool:
        order = cool + [c for c in order if c.kv_usage > config.kv_high_water]
    fair = (sum(c.load for c in order) + 1) / len(order)
    pick = next((c for c in order if not past_bound(c.load, fair, config)), None)
    if pick is None:
        pick = min(order, key=lambda c: c.load)
        decision = Decision.LOAD_FALLBACK
    elif pick is not first:
        decision = Decision.OVERFLOW
    elif worthwhile(held(pick, config), request_blocks, config):
        decision = Decision.AFFINITY
    else:
        decision = Decision.NO_MATCH
    ranks = [[pick.replica_id]] + [[c.replica_id] for c in order if c is not pick]
    return Choice(ranks=ranks, decision=decision, matched_blocks=pick.matched_blocks,
                  corrected=corrected)
