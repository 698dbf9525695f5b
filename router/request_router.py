"""PrefixAwareRequestRouter: a Ray Serve request router that sends the requests sharing a
prompt prefix to the same engine replica, and agrees with every other instance of itself.

Each ingress replica has its own instance (inside its deployment handle). They decide alike
without talking to each other because every input is shared (`router.policy`):
- the prefix's rendezvous ranking of the replicas (`router.rendezvous`: a hash of the
  prompt's first `key_blocks` blocks and the replicas' ids);
- the replicas' cache digests (`router.cache_digest`), which move a prefix ahead to where
  it really lives when that is not its first choice;
- the replicas' reported load, for bounded-load overflow, plus this instance's own sends
  since that report (`router.own_sends`: fresh, private, and shared a period later).

Enable it on the engine deployment:

    request_router_config:
      request_router_class: "router.request_router:PrefixAwareRequestRouter"
      request_router_kwargs: {block_size: 16, key_blocks: 4, abs_threshold: 16,
                              rel_threshold: 1.5, min_match_ratio: 0.1,
                              max_blocks_per_replica: 262144, kv_high_water: 0.95,
                              fetch_costs: {}}   # router/fetch_cost.py FetchCosts fields
      request_routing_stats_period_s: 1

Request contract: the handle call's first positional argument (or keyword argument
`request`) is an object with attribute `prompt_token_ids: list[int]`, or a dict with that
key. Requests without it (or shorter than a block) are ranked by their request id: spread.
A `fetch_from` attribute gets the holder to fetch the prefix from (router/fetch_hints.py);
a call with a `holder_replica` (a prefix fetch) goes to that replica only.

Routing-stats contract: the replica's `record_routing_stats()` returns a dict with these
keys (all optional; missing ones fall back to what the router itself knows):
    "cache_digest": bytes  - `router.cache_digest.CacheDigest.encode()`, same block_size
    "num_running":  int    - requests the engine is decoding/prefilling
    "num_waiting":  int    - requests queued in the engine
    "kv_usage":     float  - fraction of the KV pool in use, 0..1
    "ts":           float  - the replica's time.time() when it took these numbers

No FIFOMixin: with it Serve may hand the replica chosen for one request to a different
pending request, which would defeat prefix affinity.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from router import policy, ray_adapter, rendezvous
from router.adapter_affinity import adapter_tier, lora_of
from router.cache_digest import decode_digest
from router.fetch_cost import FetchCosts, host_weight
from router.fetch_hints import FetchHints
from router.own_sends import OwnSends
from router.policy import Candidate, Decision, PolicyConfig
from router.prefix_index import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_BLOCKS_PER_REPLICA,
    PrefixIndex,
)

logger = logging.getLogger(__name__)

STAT_CACHE_DIGEST = "cache_digest"
STAT_NUM_RUNNING = "num_running"
STAT_NUM_WAITING = "num_waiting"
STAT_KV_USAGE = "kv_usage"
STAT_TIMESTAMP = "ts"

# Requests between choose_replicas and on_request_routed (cancelled ones never reach the
# latter, so the map is bounded).
_MAX_PENDING_ROUTINGS = 4096
METRIC_PREFIX = "radixserve_router_"


def extract_token_ids(args: Sequence[Any], kwargs: dict[str, Any]) -> list[int] | None:
    """The prompt's token ids from a handle call, or None when the call has none."""
    request = args[0] if args else kwargs.get("request")
    if request is None:
        return None
    if isinstance(request, dict):
        token_ids = request.get("prompt_token_ids")
    else:
        token_ids = getattr(request, "prompt_token_ids", None)
    if isinstance(token_ids, (list, tuple)):
        return list(token_ids)
    return None


def extract_lora(args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
    """The LoRA adapter a handle call asks for, or None."""
    return lora_of(args[0] if args else kwargs.get("request"))


def channel_target(pending_request: PendingRequest | None) -> str | None:
    """The replica id a call pinned to one replica must reach, else None: a delta channel
    (deployments/channel.py) or a prefix fetch from its holder (deployments/prefix_fetch.py).
    Duck-typed on the argument's fields: the router does not import the deployments."""
    if pending_request is None or not pending_request.args:
        return None
    arg = pending_request.args[0]
    if hasattr(arg, "ingress_id") and hasattr(arg, "replica_id"):
        return arg.replica_id
    holder = getattr(arg, "holder_replica", None)
    return holder if isinstance(holder, str) else None


@dataclass
class RouterStats:
    """This instance's counters; /v1/stats sums them over every ingress replica."""

    routed_with_match: int = 0  # sent where the replica's digest held >= 1 leading block
    routed_without_match: int = 0
    overflows: int = 0  # the prefix's first choice was past its load bound: the next one
    load_fallbacks: int = 0  # every replica past its bound: the least loaded
    misroutes: int = 0  # Serve sent it elsewhere than this router's pick (the pick was full)
    digest_corrections: int = 0  # a digest moved the prefix off its rendezvous first choice
    predicted_matched_tokens: int = 0  # digest-held tokens at the replica it was sent to
    requests_without_tokens: int = 0
    digests_applied: int = 0
    digest_errors: int = 0


# The counters that sum over ingress replicas and are exported as metrics.
COUNTER_NAMES = ("routed_with_match", "routed_without_match", "overflows", "load_fallbacks",
                 "misroutes", "digest_corrections", "predicted_matched_tokens")


@dataclass
class _Routing:
    """What choose_replicas worked out for one request, reused on retries and counted when
    the request is finally routed."""

    hashes: list[int] | None  # None: the request carried no token ids
    key: int  # its rendezvous key
    lora: str | None = None  # the LoRA adapter it runs under
    pick: ReplicaID | None = None
    choice: policy.Choice | None = None


class _Counters:
    """ray.serve.metrics Counters mirroring RouterStats (best effort: metrics must never
    break routing). Prometheus sums them over the ingress replicas."""

    NAMES = COUNTER_NAMES

    def __init__(self, deployment: str) -> None:
        self._counters: dict[str, Any] = {}
        try:
            from ray.serve import metrics

            for name in self.NAMES:
                counter = metrics.Counter(
                    METRIC_PREFIX + name,
                    description=f"Prefix-aware router: {name.replace('_', ' ')}.",
                    tag_keys=("target_deployment",),
                )
                counter.set_default_tags({"target_deployment": deployment})
                self._counters[name] = counter
        except Exception:  # noqa: BLE001 - e.g. metrics unsupported in this process
            logger.debug("router metrics unavailable", exc_info=True)

    def inc(self, name: str, value: float = 1) -> None:
        counter = self._counters.get(name)
        if counter is not None and value > 0:
            counter.inc(value)


class PrefixAwareRequestRouter(RequestRouter):
    """Prefix-cache-aware routing over Serve replicas; see the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._counters = _Counters(ray_adapter.router_deployment_name(self))
        self._clock = ray_adapter.router_clock(self)  # Serve's clock (a test's, in tests)
        self.initialize_state()  # defaults; Serve calls it again with the user's kwargs

    def initialize_state(
        self,
        block_size: int = DEFAULT_BLOCK_SIZE,
        key_blocks: int = rendezvous.DEFAULT_KEY_BLOCKS,
        abs_threshold: float = PolicyConfig.abs_threshold,
        rel_threshold: float = PolicyConfig.rel_threshold,
        min_match_ratio: float = PolicyConfig.min_match_ratio,
        max_blocks_per_replica: int = DEFAULT_MAX_BLOCKS_PER_REPLICA,
        kv_high_water: float = PolicyConfig.kv_high_water,
        fetch_costs: dict[str, float] | None = None,
    ) -> None:
        if key_blocks <= 0:
            raise ValueError(f"key_blocks must be positive, got {key_blocks}")
        costs = FetchCosts(**(fetch_costs or {}))
        self._policy = PolicyConfig(
            abs_threshold=abs_threshold,
            rel_threshold=rel_threshold,
            min_match_ratio=min_match_ratio,
            kv_high_water=kv_high_water,
            host_weight=host_weight(costs),
        )
        self._key_blocks = key_blocks
        # Only the replicas' own digests go in: what every ingress knows alike.
        self._index = PrefixIndex(block_size, max_blocks_per_replica, self._clock)
        self._stats = RouterStats()
        self._routings: OrderedDict[str, _Routing] = OrderedDict()
        self._sends = OwnSends()
        self._fetch_hints = FetchHints(self._index, costs)

    # -- routing ------------------------------------------------------------------------

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Serve retries without sleeping unless told to back off; every rank we return
            # already spans all candidates, so a retry should wait.
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        target = channel_target(pending_request)
        if target is not None:  # a delta channel goes to the one replica it was opened for
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        routing = self._routing_for(pending_request)
        choice = self.decide(candidate_replicas, routing)
        routing.choice = choice
        routing.pick = choice.ranks[0][0]
        if pending_request is not None:
            self._fetch_hints.name_holder(pending_request, routing.hashes, routing.lora,
                                          routing.pick, candidate_replicas, self._load)
        if pending_request is not None:
            self._sends.pick(pending_request.metadata.internal_request_id, routing.pick,
                             self._clock())
        by_id = {r.replica_id: r for r in candidate_replicas}
        return [[by_id[rid] for rid in rank] for rank in choice.ranks]

    def decide(self, replicas: Sequence[RunningReplica], routing: _Routing) -> policy.Choice:
        """The policy's choice over `replicas` for one request (no side effects)."""
        # (the digests hold the base model's prefixes: an adapter's requests cannot use them)
        hashes = (routing.hashes or []) if routing.lora is None else []
        ranked = rendezvous.rank(routing.key, replicas, name=lambda r: r.replica_id.unique_id)
        matches = self._index.match(hashes, [r.replica_id for r in ranked])
        candidates = [Candidate(r.replica_id, matches[r.replica_id], self._load(r),
                                self._kv_usage(r), adapter_tier(r.routing_stats, routing.lora),
                                self._index.on_host(r.replica_id, hashes[:matches[r.replica_id]]))
                      for r in ranked]
        return policy.choose(len(hashes), candidates, self._policy)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        if channel_target(pending_request) is not None:
            return  # long-lived and carrying no prompt: neither load nor cache
        request_id = pending_request.metadata.internal_request_id
        routing = self._routings.pop(request_id, None) or self._new_routing(pending_request)
        self._sends.sent(request_id, replica_id, self._clock())
        if routing.hashes is None:
            return
        matched = self._index.match(routing.hashes, [replica_id])[replica_id]
        self._count_routed(matched, routing, replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._sends.completed(internal_request_id)

    # -- replica membership and stats ---------------------------------------------------

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        for rid in self._index.replicas():
            if rid not in self.curr_replicas:
                self._forget(rid)
        for replica in replicas:
            self._index.add_replica(replica.replica_id)
            self._merge_digest(replica)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    def router_stats(self) -> dict[str, int]:
        """Counters since start, plus the size of the index (for tests and debugging)."""
        out = asdict(self._stats)
        out["replicas_tracked"] = len(self._index.replicas())
        out["blocks_tracked"] = sum(self._index.num_blocks(r) for r in self._index.replicas())
        return out

    # -- helpers ------------------------------------------------------------------------

    def _routing_for(self, pending_request: PendingRequest | None) -> _Routing:
        if pending_request is None:
            return _Routing(hashes=None, key=0)
        request_id = pending_request.metadata.internal_request_id
        routing = self._routings.get(request_id)
        if routing is None:
            routing = self._routings[request_id] = self._new_routing(pending_request)
            while len(self._routings) > _MAX_PENDING_ROUTINGS:
                self._routings.popitem(last=False)
        return routing

    def _new_routing(self, pending_request: PendingRequest) -> _Routing:
        request_id = pending_request.metadata.internal_request_id
        token_ids = extract_token_ids(pending_request.args, pending_request.kwargs)
        hashes = None
        if token_ids is not None:
            try:
                hashes = self._index.hashes(token_ids)
            except Exception:  # noqa: BLE001 - e.g. ids outside int32: route by load
                logger.warning("could not hash prompt_token_ids; routing by load", exc_info=True)
        if hashes is None:
            self._stats.requests_without_tokens += 1
        key = rendezvous.prefix_key(hashes or [], self._key_blocks)
        key = rendezvous.text_key(request_id) if key is None else key
        lora = extract_lora(pending_request.args, pending_request.kwargs)
        if lora is not None:  # one adapter's requests of a prefix rank replicas alike
            key ^= rendezvous.text_key(lora)
        return _Routing(hashes=hashes, key=key, lora=lora)

    def _count_routed(self, matched_blocks: int, routing: _Routing, replica_id: ReplicaID) -> None:
        def inc(name: str, value: int = 1) -> None:
            setattr(self._stats, name, getattr(self._stats, name) + value)
            self._counters.inc(name, value)

        inc("routed_with_match" if matched_blocks > 0 else "routed_without_match")
        choice = routing.choice
        if choice is not None:
            if choice.decision == Decision.OVERFLOW:
                inc("overflows")
            elif choice.decision == Decision.LOAD_FALLBACK:
                inc("load_fallbacks")
            if choice.corrected:
                inc("digest_corrections")
        if routing.pick is not None and routing.pick != replica_id:
            inc("misroutes")
        tokens = matched_blocks * self._index.block_size
        if tokens:
            inc("predicted_matched_tokens", tokens)

    def _load(self, replica: RunningReplica) -> float:
        """The replica's own report (the same for every ingress) plus this router's sends
        since it was taken; without a report, this router's sends alone."""
        rid = replica.replica_id
        stats = replica.routing_stats or {}
        if STAT_NUM_RUNNING not in stats and STAT_NUM_WAITING not in stats:
            return float(self._sends.count(rid))
        reported = _number(stats.get(STAT_NUM_RUNNING)) + _number(stats.get(STAT_NUM_WAITING))
        taken_at = stats.get(STAT_TIMESTAMP)
        if not isinstance(taken_at, (int, float)) or isinstance(taken_at, bool):
            return max(reported, float(self._sends.count(rid)))
        return reported + self._sends.unreported(rid, float(taken_at))

    def _kv_usage(self, replica: RunningReplica) -> float:
        return _number((replica.routing_stats or {}).get(STAT_KV_USAGE))

    def _merge_digest(self, replica: RunningReplica) -> None:
        raw = (replica.routing_stats or {}).get(STAT_CACHE_DIGEST)
        if not raw:
            return
        try:
            applied = self._index.apply_digest(replica.replica_id, decode_digest(raw))
        except ValueError as e:
            self._stats.digest_errors += 1
            logger.warning("ignoring cache digest of %s: %s", replica.replica_id, e)
            return
        if applied:
            self._stats.digests_applied += 1

    def _forget(self, replica_id: ReplicaID) -> None:
        self._index.remove_replica(replica_id)
        self._sends.forget_replica(replica_id)


def _number(value: Any) -> float:
    """A published stat as a float; anything malformed counts as 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    return float(value)
