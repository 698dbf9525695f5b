"""What a request's prefix costs on each replica: found on its GPU, loaded from its host
tier, fetched from another replica's cache (deployments/prefix_fetch.py), or computed.

A pure function of the replicas' digests and load, like `router.policy`, so every ingress
plans alike. The estimate of a request's time to its first token on replica r:

    queue(r) + host load of what r holds on the host + the rest of the prefix, each token
    either computed or (where another replica holds more) fetched, whichever is cheaper

With equal queues this ranks a replica holding the prefix on its GPU first, then one
holding it on its host, then one that can fetch it, then one that computes it; a long
queue at the holders moves the request to a replica that fetches (or computes) instead.

The defaults are order-of-magnitude estimates for an 8B model (bf16 KV, 128 KiB per token)
on one H100 (scripts/bench_prefix_fetch.py and bench_host_tier.py measure them on a GPU;
the router's `fetch_costs` kwarg sets others); only their ratios matter:
- computing a prompt token: ~1e-4 s (prefill at ~10k tokens/s);
- loading one from the host tier: ~5e-6 s (PCIe at ~25 GB/s);
- fetching one from another replica: ~2e-5 s (object store copy, then the host load),
  plus ~5 ms for the two calls;
- each request ahead in a replica's queue: ~30 ms (a step's share of a busy batch).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class FetchCosts:
    compute_s_per_token: float = 1e-4
    host_load_s_per_token: float = 5e-6
    fetch_s_per_token: float = 2e-5
    fetch_overhead_s: float = 5e-3
    queue_s_per_request: float = 0.03

    def __post_init__(self) -> None:
        if min(self.compute_s_per_token, self.host_load_s_per_token, self.fetch_s_per_token,
               self.fetch_overhead_s, self.queue_s_per_request) < 0:
            raise ValueError("fetch costs must be >= 0")


@dataclass(frozen=True)
class Holding:
    """What one replica holds of the request's prompt (leading tokens), and its queue."""

    replica_id: Hashable
    gpu_tokens: int = 0
    host_tokens: int = 0  # held on its host tier beyond `gpu_tokens`
    load: float = 0  # requests running and waiting

    @property
    def held(self) -> int:
        return self.gpu_tokens + self.host_tokens


@dataclass(frozen=True)
class Plan:
    replica_id: Hashable
    fetch_from: Hashable | None  # the holder to fetch the prefix from, or None
    fetched_tokens: int
    estimate_s: float


def plan(replica: Holding, holdings: Sequence[Holding], prompt_tokens: int,
         costs: FetchCosts = FetchCosts()) -> Plan:
    """The cheapest way to the first token on `replica`: what it holds, plus a fetch from
    the replica in `holdings` that holds the most beyond it where fetching beats computing."""
    own = min(replica.held, prompt_tokens)
    base = (costs.queue_s_per_request * replica.load
            + costs.host_load_s_per_token * max(0, own - replica.gpu_tokens))
    compute_rest = costs.compute_s_per_token * (prompt_tokens - own)
    best = Plan(replica.replica_id, None, 0, base + compute_rest)
    # (among equal holders, the one with more on its GPU: less to write back first)
    holder = max((h for h in holdings if h.replica_id != replica.replica_id),
                 key=lambda h: (h.held, h.gpu_tokens), default=None)
    if holder is None or min(holder.held, prompt_tokens) <= own:
        return best
    fetched = min(holder.held, prompt_tokens) - own
    with_fetch = (base + costs.fetch_overhead_s + costs.fetch_s_per_token * fetched
                  + costs.compute_s_per_token * (prompt_tokens - own - fetched))
    if with_fetch < best.estimate_s:
        return Plan(replica.replica_id, holder.replica_id, fetched, with_fetch)
    return best


def host_weight(costs: FetchCosts) -> float:
    """What a block held on a replica's host tier is worth against one on its GPU (1) or
    none (0): the share of its compute that loading it saves."""
    if costs.compute_s_per_token <= 0:
        return 1.0
    return min(1.0, max(0.0, 1.0 - costs.host_load_s_per_token / costs.compute_s_per_token))


def rank(holdings: Sequence[Holding], prompt_tokens: int,
         costs: FetchCosts = FetchCosts()) -> list[Plan]:
    """Every replica's plan, cheapest first (ties keep `holdings`' order: the prefix's
    rendezvous order, the same on every ingress)."""
    plans = [plan(h, holdings, prompt_tokens, costs) for h in holdings]
    return sorted(plans, key=lambda p: p.estimate_s)
