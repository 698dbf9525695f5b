"""Admission at the ingress: a request over the engines' bound refused before any engine hop.

The engine replica is the authority on admission: it refuses a request when its streams in
flight reach `max_running_requests + max_queued_requests` (503, Retry-After,
`OVERLOADED_MESSAGE`). Reaching it costs a refused request the whole path: the body read
and validated, the router, an actor call and a streamed answer back, each hop queued behind
the held streams' deliveries on a loaded machine. So the ingress also refuses, in an ASGI
middleware before the body is read or a model built, when the engines themselves have just
said they are full.

The rule (`AdmissionGate.full`): a generation request (`GATED`) is refused at the ingress
only when, for every engine replica this ingress's router can send it to, the latest load
report from that replica said its streams in flight had reached its capacity, that report
arrived at most `REPORT_FRESH_S` ago, and no engine call of this ingress has finished since
or within `REPORT_FRESH_S` before (a finished call may have left room, and a report sent
before it ended may arrive after). Reports come from the engines: every delta-channel
batch carries its replica's streams in flight after that batch (its finishing streams not
counted) and capacity, and every engine 503 for capacity carries the same. Anything else -
no report, an old one, a replica without one, a router this Ray does not let us read -
goes to the engine, which decides. So a request the ingress refuses is one the engine
refused, or would have, when the report was sent; the ingress never refuses on a guess of
its own. The window in which the two can disagree is the report's age: a stream of another
ingress replica that finished after the report may have made room. While this ingress has
running streams on a replica, a new report comes with every engine step.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from deployments.auth import route_path
from deployments.errors import APIError
from router.ray_adapter import handle_request_router

# How old the engines' word may be for the ingress to refuse on it (seconds, ingress clock).
REPORT_FRESH_S = 0.25
# (method, path below the route prefix) of the requests the gate may refuse.
GATED = frozenset({("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                   ("POST", "/generate"), ("PUT", "/generate")})


class AdmissionGate:
    """The engine replicas' latest load reports, as this ingress replica received them."""

    def __init__(self, fresh_s: float = REPORT_FRESH_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fresh_s = fresh_s
        self.clock = clock
        # Replica ids the router can send to now (None: unknown, so never refuse).
        self.replicas: Callable[[], Iterable[str] | None] = lambda: None
        self._full_since: dict[str, float] = {}  # replica id -> when it last said "full"
        self._last_call_end = float("-inf")
        self.refused = 0  # requests this gate refused

    def report(self, replica_id: str, in_flight: int, capacity: int | None) -> None:
        """A replica's streams in flight and capacity (None: unbounded), as it just said."""
        if capacity is not None and in_flight >= capacity:
            self._full_since[replica_id] = self.clock()
        else:
            self._full_since.pop(replica_id, None)

    def call_finished(self) -> None:
        """An engine call of this ingress ended: room may have opened; believe no report
        for `fresh_s`. A channel batch sent before the call ended can arrive after it, and
        its "full" is already stale (seen in tests/test_serve_path.py: the gate stayed shut
        after every stream was cancelled)."""
        self._last_call_end = self.clock()
        if self._full_since:
            self._full_since.clear()

    def forget(self, replica_id: str) -> None:
        self._full_since.pop(replica_id, None)

    def full(self) -> bool:
        """Every replica the router can pick has said, recently enough, that it is full."""
        if not self._full_since or self.clock() - self._last_call_end < self.fresh_s:
            return False
        replicas = self.replicas()
        if not replicas:
            return False
        oldest = self.clock() - self.fresh_s
        return all(self._full_since.get(r, -1e300) >= oldest for r in replicas)


def engine_replica_ids(*handles) -> list[str] | None:
    """The ids of the replicas the first of the deployment `handles` whose router can be read
    can send to now, or None when none can (not yet built, or a Ray that moved it:
    router/ray_adapter.py)."""
    for handle in handles:
        router = handle_request_router(handle)
        if router is None:
            continue
        try:
            return [replica_id.unique_id for replica_id in list(router.curr_replicas)]
        except Exception:  # noqa: BLE001 - a router without the public base class's state
            continue
    return None


class AdmissionMiddleware:
    """Plain ASGI: a gated request meets `gate.full()` before FastAPI routes it or reads its
    body; a full gate answers the engine's own 503 (Retry-After, OVERLOADED_MESSAGE)."""

    def __init__(self, app, gate: AdmissionGate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] == "http" and self.gate.full()
                and (scope["method"], route_path(scope)) in GATED):
            self.gate.refused += 1
            await APIError.unavailable().to_response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


def install_admission(app) -> AdmissionGate:
    """Gate the app's generation requests; returns the gate, for the ingress to feed."""
    gate = AdmissionGate()
    app.add_middleware(AdmissionMiddleware, gate=gate)
    return gate
