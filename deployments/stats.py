"""`GET /v1/stats`: a JSON summary of every engine replica plus the router's counters, for
a quick look without Prometheus (like SGLang's metric summary).

The ingress asks every replica at once with `DeploymentHandle.broadcast` (Ray >= 2.60;
older Ray falls back to the one replica the handle picks). Counts are summed, ratios are
recomputed from the sums, and each replica's own numbers stay under "replicas". The
router's counters come from the request router object inside each ingress replica's
handle (Serve does not expose it publicly), summed over every ingress replica by a
broadcast to the ingress deployment itself: one ingress routes only its share of the
traffic. When no router can be reached, "router" is left out.
"""
from __future__ import annotations

import logging
from typing import Any

from router.ray_adapter import handle_request_router

logger = logging.getLogger(__name__)

BROADCAST_TIMEOUT_S = 10.0
# Ratios of engine.stats(), recomputed from the summed counts rather than summed.
RATIOS = ("cache_hit_rate", "kv_usage")
# A router's index sizes: each ingress tracks every replica, so these are not added up.
ROUTER_INDEX_SIZES = ("replicas_tracked", "blocks_tracked")


def aggregate(per_replica: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Sum the replicas' counts (integers) and time totals (`_seconds`); recompute the ratios."""
    total: dict[str, Any] = {}
    for stats in per_replica.values():
        for key, value in stats.items():
            summed = isinstance(value, int) or key.endswith("_seconds")
            if summed and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
    prompt = total.get("prompt_tokens", 0)
    total["cache_hit_rate"] = total.get("cached_tokens", 0) / prompt if prompt else 0.0
    slots = total.get("total_slots", 0)
    idle = total.get("free_slots", 0) + total.get("evictable_slots", 0)
    total["kv_usage"] = 1.0 - idle / slots if slots else 0.0
    return total


async def replica_stats(handle: Any) -> tuple[dict[str, dict[str, Any]], int]:
    """({replica id: engine stats}, number of replicas that did not answer)."""
    if not hasattr(handle, "broadcast"):
        return {"unknown": await handle.stats.remote()}, 0
    try:
        response = handle.broadcast("replica_stats")
        results = await response.results_async(timeout_s=BROADCAST_TIMEOUT_S, return_exceptions=True)
    except Exception as e:  # noqa: BLE001 - e.g. no replica running: say so, don't fail
        logger.warning("stats broadcast failed: %r", e)
        return {}, 1
    answered = {r["replica"]: r["stats"] for r in results if isinstance(r, dict)}
    failed = len(results) - len(answered)
    if failed:
        logger.warning("%d engine replica(s) did not answer the stats broadcast", failed)
    return answered, failed


def router_stats(handle: Any) -> dict[str, Any] | None:
    """The prefix router's counters (`router_stats()`), if this handle's router has them.

    Serve does not expose the handle's router publicly (router/ray_adapter.py reaches it):
    a Ray that moved it only drops "router".
    """
    try:
        return dict(handle_request_router(handle).router_stats())
    except Exception:  # noqa: BLE001 - not reachable, or not our router
        return None


def sum_router_stats(parts: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Every ingress's router counters added up (None when none answered); "ingress_replicas"
    says how many did. Sizes of each router's own index are not summed: they are per ingress."""
    answered = [p for p in parts if isinstance(p, dict)]
    if not answered:
        return None
    total: dict[str, Any] = {}
    for part in answered:
        for key, value in part.items():
            if isinstance(value, int) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
    for key in ROUTER_INDEX_SIZES:
        if key in total:
            total[key] = max(p.get(key, 0) for p in answered)
    total["ingress_replicas"] = len(answered)
    return total


async def fleet_router_stats(ingress_handle: Any | None, local: dict[str, Any] | None) -> dict[str, Any] | None:
    """The router counters of every replica of this ingress deployment, summed; this
    replica's own (`local`) when the others cannot be asked."""
    if ingress_handle is None or not hasattr(ingress_handle, "broadcast"):
        return sum_router_stats([local])
    try:
        response = ingress_handle.broadcast("router_counters")
        parts = await response.results_async(timeout_s=BROADCAST_TIMEOUT_S, return_exceptions=True)
    except Exception as e:  # noqa: BLE001 - the numbers of this replica are still worth showing
        logger.warning("router stats broadcast failed: %r", e)
        return sum_router_stats([local])
    return sum_router_stats(parts)


async def summary(handle: Any, ingress_handle: Any | None = None) -> dict[str, Any]:
    """The `/v1/stats` body: summed engine stats at the top level (the keys of
    `engine.stats()`, as with one replica), then `num_replicas`, `replicas`, `router`
    (summed over the ingress replicas when `ingress_handle` reaches them)."""
    per_replica, failed = await replica_stats(handle)
    out = aggregate(per_replica)
    out["num_replicas"] = len(per_replica)
    if failed:
        out["replicas_not_answering"] = failed
    out["replicas"] = per_replica
    router = await fleet_router_stats(ingress_handle, router_stats(handle))
    if router is not None:
        out["router"] = router
    return out


class FleetStats:
    """`/v1/stats` from inside an ingress replica: the engine replicas through `engine`
    (a deployment handle), the router counters of every ingress replica through a handle to
    this replica's own deployment (made on first use: a replica's context exists only once
    its constructor runs inside Serve)."""

    def __init__(self, engine: Any, in_process: bool = False) -> None:
        self.engine = engine
        self.in_process = in_process  # colocated: no router anywhere, nothing to ask
        self._ingress: Any | None = None

    def ingress_handle(self) -> Any | None:
        if self._ingress is None and not self.in_process:
            try:
                from ray import serve

                context = serve.get_replica_context()
                self._ingress = serve.get_deployment_handle(context.deployment, context.app_name)
            except Exception:  # noqa: BLE001 - outside Serve: this replica's counters only
                return None
        return self._ingress

    def router_counters(self) -> dict[str, Any] | None:
        return router_stats(self.engine)

    async def summary(self) -> dict[str, Any]:
        return await summary(self.engine, self.ingress_handle())
