"""`GET /v1/stats`: a JSON summary of every engine replica plus the router's counters, for
a quick look without Prometheus (like SGLang's metric summary).

The ingress asks every replica at once with `DeploymentHandle.broadcast` (Ray >= 2.60;
older Ray falls back to the one replica the handle picks). Counts are summed, ratios are
recomputed from the sums, and each replica's own numbers stay under "replicas". The
router's counters come from the request router object inside the ingress's handle, which
Serve does not expose publicly: when it cannot be reached, "router" is left out.
"""
from __future__ import annotations

import logging
from typing import Any

from router.ray_adapter import handle_request_router

logger = logging.getLogger(__name__)

BROADCAST_TIMEOUT_S = 10.0
# Ratios of engine.stats(), recomputed from the summed counts rather than summed.
RATIOS = ("cache_hit_rate", "kv_usage")


def aggregate(per_replica: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Sum the replicas' counts (integers); recompute the ratios."""
    total: dict[str, Any] = {}
    for stats in per_replica.values():
        for key, value in stats.items():
            if isinstance(value, int) and not isinstance(value, bool):
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


async def summary(handle: Any) -> dict[str, Any]:
    """The `/v1/stats` body: summed engine stats at the top level (the keys of
    `engine.stats()`, as with one replica), then `num_replicas`, `replicas`, `router`."""
    per_replica, failed = await replica_stats(handle)
    out = aggregate(per_replica)
    out["num_replicas"] = len(per_replica)
    if failed:
        out["replicas_not_answering"] = failed
    out["replicas"] = per_replica
    router = router_stats(handle)
    if router is not None:
        out["router"] = router
    return out
