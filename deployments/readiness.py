"""Engine readiness at the ingress: /health, /v1/models and requests that need an engine
answer from local state, within milliseconds, even while the engine starts.

Serve counts an engine replica as running once its constructor has returned (the engine is
built, its CUDA graphs captured and its warm-up done: deployments/engine_replica.py) and its
first health check has passed; only then do routers get it, and only then is the app
RUNNING. The ingress's handle to the engine deployment hears of every such change from
Serve's controller (a long poll), so the replicas its router can pick are Serve's own word
on readiness, and reading them costs a probe nothing: it never waits on an engine, busy or
starting (a handle call per probe would wait in the router for a replica, until its own
timeout, while the engine starts). Where this Ray does not let the router be read (router/ray_adapter.py), readiness
falls back to whether an engine replica has answered the ingress's one call at start-up
(`EngineReadiness.watch`, which Serve holds until a replica runs).

While no engine replica is ready, the ingress answers every request that needs one with
503, `Retry-After` and `STARTING_MESSAGE` (code `engine_starting`), before reading its body:
/health and /v1/models agree, and a completion sent during start-up is refused at once
rather than held (docs/deploy.md, "Start-up and readiness").

The ingress's own parts (tokenizer, model config: deployments/ingress_parts.py) load after
its constructor, so that Serve routes to it at once. Until they are in, every request but a
/metrics scrape gets the same 503; except once an engine replica is ready, when the request
waits for them instead, since Serve already calls the app running.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

from deployments.admission import GATED
from deployments.auth import route_path
from deployments.errors import APIError

logger = logging.getLogger(__name__)

STARTING_MESSAGE = ("The engine is starting: no engine replica can serve yet; retry after "
                    "the Retry-After interval.")
STARTING_CODE = "engine_starting"
STARTING_RETRY_AFTER_S = 1
WATCH_RETRY_S = 1.0  # after a failed start-up call (e.g. a replica that died answering it)
# Paths (any method) that need an engine replica, besides the generation requests (`GATED`).
# /v1/models is here so that it agrees with /health: a listed model is one that can serve.
ENGINE_ROUTES = frozenset({"/health", "/health_generate", "/flush_cache", "/v1/models"})
# What answers while the ingress's own parts (tokenizer, model config) still load: a scrape
# reads only counters (deployments/ingress_parts.py).
NO_PARTS_ROUTES = frozenset({"/metrics"})
# Once an engine replica is ready a request waits for the parts rather than meet a 503 from
# an app Serve already calls running (they load in seconds; the engine takes longer).
PARTS_WAIT_S = 120.0
PARTS_MESSAGE = ("The server is starting: this ingress replica is loading its tokenizer and "
                 "model config; retry after the Retry-After interval.")
PARTS_FAILED_CODE = "ingress_failed"
PARTS_FAILED_MESSAGE = "This ingress replica could not load its tokenizer and model config: "


class LocalParts(Protocol):
    """The ingress's own start-up (deployments/ingress_parts.py's PartsLoader)."""

    loaded: bool
    error: str | None

    async def wait(self, timeout_s: float) -> None:
        """Return once loaded, failed, or after `timeout_s`."""


def needs_engine(method: str, path: str) -> bool:
    """Does this request need an engine replica (refused while none is ready)?"""
    return ((method, path) in GATED or path in ENGINE_ROUTES
            or path.startswith("/v1/models/"))


def starting_error() -> APIError:
    return APIError(STARTING_MESSAGE, 503, code=STARTING_CODE,
                    headers={"Retry-After": str(STARTING_RETRY_AFTER_S)})


class EngineReadiness:
    """Whether an engine replica can take this ingress's requests now."""

    def __init__(self) -> None:
        # Replica ids the ingress's router can pick (None: the router cannot be read).
        self.replicas: Callable[[], Iterable[str] | None] = lambda: None
        self.answered = False  # an engine replica answered (or the engine is in-process)
        self.refused = 0  # requests refused while no engine replica was ready

    def follow(self, replicas: Callable[[], Iterable[str] | None],
               ping: Callable[[], Awaitable]) -> None:
        """Track the engine deployment behind the ingress's handle: the replicas its router
        can pick, and, as the fallback signal, one `ping()` answered."""
        self.replicas = replicas
        self._watch = asyncio.ensure_future(self.watch(ping))

    def ready(self) -> bool:
        replicas = self.replicas()
        return self.answered if replicas is None else any(True for _ in replicas)

    async def watch(self, ping: Callable[[], Awaitable]) -> None:
        """Await one answer from any engine replica: the fallback readiness signal."""
        while not self.answered:
            try:
                await ping()
            except Exception as e:  # noqa: BLE001 - the replica went away: wait for the next
                logger.warning("engine readiness call failed (%s); trying again", type(e).__name__)
                await asyncio.sleep(WATCH_RETRY_S)
            else:
                self.answered = True


class ReadinessMiddleware:
    """Plain ASGI: a request that needs an engine meets `readiness.ready()` before FastAPI
    routes it or reads its body; while the ingress's own parts load (`parts`), every request
    but a /metrics scrape is refused the same way."""

    def __init__(self, app, readiness: EngineReadiness, parts: LocalParts) -> None:
        self.app = app
        self.readiness = readiness
        self.parts = parts

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            error = await self._refusal(scope["method"], route_path(scope))
            if error is not None:
                self.readiness.refused += 1
                await error.to_response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _refusal(self, method: str, path: str) -> APIError | None:
        if path in NO_PARTS_ROUTES:
            return None
        engine_ready = self.readiness.ready()
        if not self.parts.loaded:
            if engine_ready:  # Serve calls the app running: the parts are all but in
                await self.parts.wait(PARTS_WAIT_S)
            if self.parts.error is not None:
                return APIError(f"{PARTS_FAILED_MESSAGE}{self.parts.error}", 503,
                                code=PARTS_FAILED_CODE)
            if not self.parts.loaded:
                return APIError(PARTS_MESSAGE, 503, code=STARTING_CODE,
                                headers={"Retry-After": str(STARTING_RETRY_AFTER_S)})
        if needs_engine(method, path) and not engine_ready:
            return starting_error()
        return None


def install_readiness(app, parts: LocalParts) -> EngineReadiness:
    """Refuse the app's engine requests while no engine replica is ready, and every request
    while `parts` load; returns the readiness state, for the ingress to wire to its engine
    handle."""
    readiness = EngineReadiness()
    app.add_middleware(ReadinessMiddleware, readiness=readiness, parts=parts)
    return readiness
