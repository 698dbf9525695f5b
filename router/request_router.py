"""PrefixAwareRequestRouter: a Ray Serve request router that sends each request to the
replica most likely to hold its prompt's prefix in the radix cache, unless load says
otherwise (see `router.policy`).

Enable it on the engine deployment:

    request_router_config:
      request_router_class: "router.request_router:PrefixAwareRequestRouter"
      request_router_kwargs: {block_size: 16, abs_threshold: 16, rel_threshold: 1.5,
                              min_match_ratio: 0.1, max_blocks_per_replica: 262144,
                              kv_high_water: 0.95, digest_grace_s: 1.0}
      request_routing_stats_period_s: 2

Request contract: the handle call's first positional argument (or keyword argument
`request`) is an object with attribute `prompt_token_ids: list[int]`, or a dict with that
key. Requests without it are routed by load alone.

Routing-stats contract: the replica's `record_routing_stats()` returns a dict with these
keys (all optional; missing ones fall back to what the router itself knows):
    "cache_digest": bytes  - `router.cache_digest.CacheDigest.encode()`, same block_size
    "num_running":  int    - requests the engine is decoding/prefilling
    "num_waiting":  int    - requests queued in the engine
    "kv_usage":     float  - fraction of the KV pool in use, 0..1

Load of a replica = Serve's own queue-length cache entry when fresh (it tracks rejections
and this router's sends), else num_running + num_waiting from the last stats, and never
less than the requests this router has in flight there.

Design notes:
- No FIFOMixin: with it Serve may hand the replica chosen for one request to a different
  pending request, which would defeat prefix affinity. The base class matches each
  replica to the exact request it was chosen for.
- The first rank is always one replica, picked by this router (ties: least loaded, then
  the smallest believed cache, so new prefixes spread over the replicas), and the request
  is recorded there at once, before Serve has even sent it: requests with the same prefix
  that arrive while the first is in transit (a burst) follow it instead of scattering.
  If Serve sends it elsewhere after all (the pick was full), `on_request_routed` moves the
  record to the real replica (withdrawing the entries nothing else has touched since).
  A request chosen for but not yet sent to a replica counts towards that replica's load
  for `_TENTATIVE_TTL_S` (Serve's own queue-length cache only learns of it on sending).
- `on_request_routed` is only called by Serve when replicas may reject requests (strict
  max_ongoing_requests, the default outside Ray Client); without it, routing relies on the
  tentative records and the replicas' digests.
"""
from __future__ import annotations

import logging
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from router import policy, ray_adapter
from router.cache_digest import decode_digest
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

# Requests between choose_replicas and on_request_routed (cancelled ones never reach the
# latter, so the map is bounded).
_MAX_PENDING_ROUTINGS = 4096
# How long a request chosen for a replica (not yet confirmed sent) counts as its load.
_TENTATIVE_TTL_S = 2.0
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


def channel_target(pending_request: PendingRequest | None) -> str | None:
    """The replica id a delta-channel call (deployments/channel.py) must reach, else None.
    Duck-typed on the argument's fields: the router does not import the deployments."""
    if pending_request is None or not pending_request.args:
        return None
    arg = pending_request.args[0]
    if hasattr(arg, "ingress_id") and hasattr(arg, "replica_id"):
        return arg.replica_id
    return None


@dataclass
class RouterStats:
    routed_with_match: int = 0  # sent where the index believed >= 1 block was cached
    routed_without_match: int = 0
    load_fallbacks: int = 0  # the policy overrode affinity/no-match because of load
    predicted_matched_tokens: int = 0  # believed cached tokens at the chosen replica
    requests_without_tokens: int = 0
    digests_applied: int = 0
    digest_errors: int = 0


@dataclass
class _Routing:
    """What choose_replicas worked out for one request, reused on retries and when the
    request is finally routed."""

    hashes: list[int] | None  # None: the request carried no token ids
    decision: Decision | None = None
    # Believed matched blocks per replica when first chosen (before the tentative record
    # of this very request): the prediction, and stable across retries.
    matches: dict[ReplicaID, int] | None = None
    tentative: ReplicaID | None = None  # the replica picked last, until routed
    tentative_at: float = 0.0  # when its blocks were recorded there


class _Counters:
    """ray.serve.metrics Counters mirroring RouterStats (best effort: metrics must never
    break routing)."""

    NAMES = ("routed_with_match", "routed_without_match", "load_fallbacks",
             "predicted_matched_tokens")

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
        abs_threshold: float = PolicyConfig.abs_threshold,
        rel_threshold: float = PolicyConfig.rel_threshold,
        min_match_ratio: float = PolicyConfig.min_match_ratio,
        max_blocks_per_replica: int = DEFAULT_MAX_BLOCKS_PER_REPLICA,
        kv_high_water: float = PolicyConfig.kv_high_water,
        digest_grace_s: float = 1.0,
    ) -> None:
        self._policy = PolicyConfig(
            abs_threshold=abs_threshold,
            rel_threshold=rel_threshold,
            min_match_ratio=min_match_ratio,
            kv_high_water=kv_high_water,
        )
        self._index = PrefixIndex(block_size, max_blocks_per_replica, self._clock)
        self._digest_grace_s = digest_grace_s
        self._stats = RouterStats()
        self._routings: OrderedDict[str, _Routing] = OrderedDict()
        self._in_flight: defaultdict[ReplicaID, int] = defaultdict(int)
        self._in_flight_requests: dict[str, ReplicaID] = {}
        # request id -> (picked replica, when): chosen but not yet confirmed routed.
        self._tentative: OrderedDict[str, tuple[ReplicaID, float]] = OrderedDict()

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
        hashes = routing.hashes or []
        ids = [r.replica_id for r in candidate_replicas]
        if routing.matches is None or any(rid not in routing.matches for rid in ids):
            routing.matches = self._index.match(hashes, ids)
        loads = {r.replica_id: self._load(r) for r in candidate_replicas}
        candidates = [
            Candidate(r.replica_id, routing.matches[r.replica_id], loads[r.replica_id],
                      self._kv_usage(r))
            for r in candidate_replicas
        ]
        choice = policy.choose(len(hashes), candidates, self._policy)
        routing.decision = choice.decision
        by_id = {r.replica_id: r for r in candidate_replicas}
        first = choice.ranks[0]
        pick = min(first, key=lambda rid: (loads[rid], self._index.num_blocks(rid)))
        ranks = [[pick], [rid for rid in first if rid != pick], *choice.ranks[1:]]
        if pending_request is not None:
            self._record_tentative(pending_request, routing, pick)
        return [[by_id[rid] for rid in rank] for rank in ranks if rank]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        if channel_target(pending_request) is not None:
            return  # long-lived and carrying no prompt: neither load nor cache
        request_id = pending_request.metadata.internal_request_id
        routing = self._routings.pop(request_id, None) or self._new_routing(pending_request)
        self._tentative.pop(request_id, None)
        self._withdraw_tentative(routing, keep=replica_id)
        self._in_flight[replica_id] += 1
        self._in_flight_requests[request_id] = replica_id
        if routing.hashes is None:
            return
        if routing.matches is not None and replica_id in routing.matches:
            matched = routing.matches[replica_id]
        else:
            matched = self._index.match(routing.hashes, [replica_id])[replica_id]
        self._index.record_routed(replica_id, routing.hashes)
        self._count_routed(matched, routing.decision)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        routed_to = self._in_flight_requests.pop(internal_request_id, None)
        if routed_to is not None and self._in_flight.get(routed_to, 0) > 0:
            self._in_flight[routed_to] -= 1

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
            return _Routing(hashes=None)
        request_id = pending_request.metadata.internal_request_id
        routing = self._routings.get(request_id)
        if routing is None:
            routing = self._routings[request_id] = self._new_routing(pending_request)
            while len(self._routings) > _MAX_PENDING_ROUTINGS:
                old_id, _ = self._routings.popitem(last=False)
                self._tentative.pop(old_id, None)
        return routing

    def _record_tentative(self, pending_request: PendingRequest, routing: _Routing,
                          replica_id: ReplicaID) -> None:
        """The request will most likely run on `replica_id`: believe so now."""
        request_id = pending_request.metadata.internal_request_id
        now = self._clock()
        self._tentative.pop(request_id, None)
        self._tentative[request_id] = (replica_id, now)
        while self._tentative:  # oldest first: drop the expired (cancelled, never routed)
            _, (_, t) = next(iter(self._tentative.items()))
            if t >= now - _TENTATIVE_TTL_S and len(self._tentative) <= _MAX_PENDING_ROUTINGS:
                break
            self._tentative.popitem(last=False)
        if routing.tentative != replica_id:
            self._withdraw_tentative(routing, keep=replica_id)
            if routing.hashes:
                self._index.record_routed(replica_id, routing.hashes, now)
            routing.tentative, routing.tentative_at = replica_id, now

    def _withdraw_tentative(self, routing: _Routing, keep: ReplicaID) -> None:
        """Undo the tentative record of `routing` unless it was for `keep`."""
        if routing.tentative is not None and routing.tentative != keep and routing.hashes:
            self._index.forget_routed(routing.tentative, routing.hashes, routing.tentative_at)
        routing.tentative = None

    def _tentative_load(self, replica_id: ReplicaID) -> int:
        cutoff = self._clock() - _TENTATIVE_TTL_S
        return sum(1 for rid, t in self._tentative.values() if rid == replica_id and t >= cutoff)

    def _new_routing(self, pending_request: PendingRequest) -> _Routing:
        token_ids = extract_token_ids(pending_request.args, pending_request.kwargs)
        if token_ids is None:
            self._stats.requests_without_tokens += 1
            return _Routing(hashes=None)
        try:
            return _Routing(hashes=self._index.hashes(token_ids))
        except Exception:  # noqa: BLE001 - e.g. ids outside int32: route by load
            logger.warning("could not hash prompt_token_ids; routing by load", exc_info=True)
            self._stats.requests_without_tokens += 1
            return _Routing(hashes=None)

    def _count_routed(self, matched_blocks: int, decision: Decision | None) -> None:
        if matched_blocks > 0:
            self._stats.routed_with_match += 1
            self._counters.inc("routed_with_match")
        else:
            self._stats.routed_without_match += 1
            self._counters.inc("routed_without_match")
        if decision == Decision.LOAD_FALLBACK:
            self._stats.load_fallbacks += 1
            self._counters.inc("load_fallbacks")
        tokens = matched_blocks * self._index.block_size
        self._stats.predicted_matched_tokens += tokens
        self._counters.inc("predicted_matched_tokens", tokens)

    def _load(self, replica: RunningReplica) -> float:
        known: float | None = None
        if ray_adapter.router_uses_queue_len_cache(self):
            known = self.replica_queue_len_cache.get(replica.replica_id)
        if known is None:
            stats = replica.routing_stats or {}
            if STAT_NUM_RUNNING in stats or STAT_NUM_WAITING in stats:
                known = _number(stats.get(STAT_NUM_RUNNING)) + _number(stats.get(STAT_NUM_WAITING))
        own = self._in_flight.get(replica.replica_id, 0) + self._tentative_load(replica.replica_id)
        return max(known or 0.0, float(own))

    def _kv_usage(self, replica: RunningReplica) -> float:
        return _number((replica.routing_stats or {}).get(STAT_KV_USAGE))

    def _merge_digest(self, replica: RunningReplica) -> None:
        raw = (replica.routing_stats or {}).get(STAT_CACHE_DIGEST)
        if not raw:
            return
        try:
            applied = self._index.apply_digest(
                replica.replica_id, decode_digest(raw), self._digest_grace_s
            )
        except ValueError as e:
            self._stats.digest_errors += 1
            logger.warning("ignoring cache digest of %s: %s", replica.replica_id, e)
            return
        if applied:
            self._stats.digests_applied += 1

    def _forget(self, replica_id: ReplicaID) -> None:
        self._index.remove_replica(replica_id)
        self._in_flight.pop(replica_id, None)
        for request_id in [k for k, v in self._in_flight_requests.items() if v == replica_id]:
            del self._in_flight_requests[request_id]
        for request_id in [k for k, (v, _) in self._tentative.items() if v == replica_id]:
            del self._tentative[request_id]


def _number(value: Any) -> float:
    """A published stat as a float; anything malformed counts as 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    return float(value)
