"""`GET /metrics`: Prometheus text for the whole app, from whichever ingress replica the
scrape reaches (HAProxy and Serve's proxy pick any).

The ingress asks every replica for its snapshot at once (`DeploymentHandle.broadcast`): the
engine replicas (engine stats + their processes' recorded metrics) and the ingress replicas,
itself included (HTTP and router counters). Each replica's samples keep their own label
(`engine=` or `ingress=`, Serve's replica id) rather than being summed here: a replica that
leaves, or misses one scrape, then only ends its series, where a sum would drop and read as
a counter reset to Prometheus. PromQL sums them (`sum(rate(vllm:prompt_tokens_total[1m]))`).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.responses import Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from deployments.local_metrics import process_metrics
from deployments.stats import router_stats
from deployments.served_metrics import (
    ENGINE, INGRESS, RECORDED, ROUTER, SCRAPE_MISSING, SCRAPE_MISSING_HELP, SCRAPE_REPLICAS,
    SCRAPE_REPLICAS_HELP, SERVED, STAT, Served,
)

logger = logging.getLogger(__name__)

# The text format every Prometheus reads (what vLLM serves).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Below Prometheus's default scrape timeout (10 s): a late replica costs its series, not
# the whole scrape.
BROADCAST_TIMEOUT_S = 5.0
Snapshot = dict[str, Any]  # {"replica", "engine": stats | None, "router": ... | None, "recorded": ...}


def replica_context() -> Any | None:
    """Serve's context of the replica running this code, or None outside Serve."""
    try:
        from ray import serve

        return serve.get_replica_context()
    except Exception:  # noqa: BLE001
        return None


async def broadcast_snapshots(handle: Any) -> tuple[list[Snapshot], int]:
    """(every replica's `metrics_snapshot()`, how many did not answer in time)."""
    try:
        response = handle.broadcast("metrics_snapshot")
        results = await response.results_async(timeout_s=BROADCAST_TIMEOUT_S, return_exceptions=True)
    except Exception as e:  # noqa: BLE001 - e.g. no replica running: report, don't fail
        logger.warning("metrics broadcast failed: %r", e)
        return [], 1
    answered = [r for r in results if isinstance(r, dict)]
    return answered, len(results) - len(answered)


async def app_snapshots(own: Callable[[], Awaitable[Snapshot]], peers: Any | None,
                        engines: Any | None) -> tuple[list[Snapshot], dict[str, tuple[int, int]]]:
    """Snapshots of the whole app: `peers` (this deployment's handle, or None: this replica
    alone) and `engines` (the engine deployment's handle; None when the engine lives in
    these replicas). Returns them and, by role, (replicas that answered, that did not)."""
    async def ours() -> tuple[list[Snapshot], int]:
        return ([await own()], 0) if peers is None else await broadcast_snapshots(peers)

    async def nothing() -> tuple[list[Snapshot], int]:
        return [], 0

    (snapshots, ingress_missing), (more, engine_missing) = await asyncio.gather(
        ours(), broadcast_snapshots(engines) if engines is not None else nothing())
    counts = {INGRESS: (len(snapshots), ingress_missing)}
    snapshots = snapshots + more
    counts[ENGINE] = (sum(1 for s in snapshots if s.get("engine") is not None), engine_missing)
    return snapshots, counts


def ingress_snapshot(engine_handle: Any) -> Snapshot:
    """An ingress replica's snapshot: its process's records and its router's counters."""
    context = replica_context()
    return {"replica": context.replica_id.unique_id if context else "local",
            "router": router_stats(engine_handle), "recorded": process_metrics().snapshot()}


class PrometheusEndpoint:
    """`GET /metrics` of the ingress app; the ingress constructor says what to ask."""

    def __init__(self) -> None:
        self.model_name = ""
        self._own: Callable[[], Awaitable[Snapshot]] | None = None
        self._engines: Any | None = None
        self._peers: Any | None = None

    def configure(self, model_name: str, own: Callable[[], Awaitable[Snapshot]],
                  engines: Any | None) -> None:
        """`own`: this replica's snapshot; `engines`: the engine deployment's handle, or
        None when the engine lives in the ingress replicas (`ingress: colocated`)."""
        self.model_name, self._own, self._engines = model_name, own, engines

    async def handle(self) -> Response:
        if self._own is None:
            return Response("the ingress is starting\n", status_code=503, media_type=CONTENT_TYPE)
        snapshots, counts = await app_snapshots(self._own, self._peer_handle(), self._engines)
        return Response(render(snapshots, self.model_name, counts), media_type=CONTENT_TYPE)

    def _peer_handle(self) -> Any | None:
        """A handle to this replica's own deployment (every ingress replica), or None
        outside Serve."""
        if self._peers is None:
            context = replica_context()
            if context is not None:
                from ray import serve

                self._peers = serve.get_deployment_handle(context.deployment, context.app_name)
        return self._peers


def install_prometheus_endpoint(api: Any) -> PrometheusEndpoint:
    endpoint = PrometheusEndpoint()
    api.add_api_route("/metrics", endpoint.handle, methods=["GET"], include_in_schema=False)
    return endpoint


# -- Rendering --------------------------------------------------------------------------


def render(snapshots: list[Snapshot], model_name: str, counts: dict[str, tuple[int, int]]) -> bytes:
    """`counts`: by role, (replicas that answered, that did not)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(snapshots, model_name, counts))
    return generate_latest(registry)


class _Collector:
    def __init__(self, snapshots: list[Snapshot], model_name: str,
                 counts: dict[str, tuple[int, int]]) -> None:
        self.snapshots, self.model_name, self.counts = snapshots, model_name, counts

    def collect(self):
        for served in SERVED:
            family = _family(served, self.snapshots, self.model_name)
            if family.samples:
                yield family
        for name, help_text, column in ((SCRAPE_REPLICAS, SCRAPE_REPLICAS_HELP, 0),
                                        (SCRAPE_MISSING, SCRAPE_MISSING_HELP, 1)):
            family = GaugeMetricFamily(name, help_text, labels=["model_name", "role"])
            for role, pair in sorted(self.counts.items()):
                family.add_metric([self.model_name, role], pair[column])
            yield family


def _family(served: Served, snapshots: list[Snapshot], model_name: str):
    labels = ["model_name", served.role, *(label for _, label in served.tags)]
    if served.kind == "histogram":
        family = HistogramMetricFamily(served.name, served.help, labels=labels)
    elif served.kind == "counter":
        family = CounterMetricFamily(served.name, served.help, labels=labels)
    else:
        family = GaugeMetricFamily(served.name, served.help, labels=labels)
    for snap in snapshots:
        for tag_values, value in _samples(served, snap):
            label_values = [model_name, snap["replica"], *tag_values]
            if served.kind == "histogram":
                bounds, counts, total = value
                family.add_metric(label_values, _cumulative(bounds, counts), total)
            else:
                family.add_metric(label_values, value)
    return family


def _samples(served: Served, snap: Snapshot):
    """(tag values, value) of one replica: a number, or (bounds, counts, sum)."""
    if served.source in (STAT, ROUTER):
        source = snap.get("engine" if served.source == STAT else "router") or {}
        if served.key in source:
            yield (), source[served.key]
        return
    assert served.source == RECORDED
    recorded = snap.get("recorded") or {}
    rows = recorded.get("histograms" if served.kind == "histogram" else "values", [])
    for name, tags, *value in rows:
        if name != served.key:
            continue
        tag_values = [tags.get(tag, "") for tag, _ in served.tags]
        if served.only and tag_values[0] not in served.only:
            continue
        yield tag_values, (tuple(value) if served.kind == "histogram" else value[0])


def _cumulative(bounds: list[float], counts: list[int]) -> list[tuple[str, float]]:
    out, running = [], 0
    for bound, count in zip([*bounds, float("inf")], counts):
        running += count
        out.append((floatToGoString(bound), running))
    return out
