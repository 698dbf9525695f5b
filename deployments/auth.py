"""API keys: `Authorization: Bearer <key>` on every endpoint but /health and /metrics.

Keys come from the app args (`api_key`, `admin_api_key`) or, for a Kubernetes secret, the
environment of the ingress replicas (RADIXSERVE_API_KEY, RADIXSERVE_ADMIN_API_KEY); an arg
wins. Admin endpoints (/flush_cache, LoRA loading) take the admin key when one is set, else
the API key.
Keys are compared in constant time and never logged. No key set = no authentication.
"""
from __future__ import annotations

import hmac
import os

from fastapi import FastAPI

from deployments.errors import APIError

# Probes (Kubernetes, load balancers) and Prometheus carry no key: vLLM leaves /metrics
# open too (docs/monitoring.md says what it shows and how to fence it).
OPEN_PATHS = frozenset({"/health", "/metrics"})
ADMIN_PATHS = frozenset({"/flush_cache", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
                         "/load_lora_adapter", "/unload_lora_adapter"})
API_KEY_ENV = "RADIXSERVE_API_KEY"
ADMIN_API_KEY_ENV = "RADIXSERVE_ADMIN_API_KEY"


class KeyCheck:
    """The keys of this ingress replica (set once, from its constructor)."""

    def __init__(self) -> None:
        self.api_key: bytes | None = None
        self.admin_key: bytes | None = None

    def configure(self, api_key: str | None, admin_api_key: str | None) -> None:
        api_key = api_key or os.environ.get(API_KEY_ENV) or None
        admin_api_key = admin_api_key or os.environ.get(ADMIN_API_KEY_ENV) or None
        self.api_key = api_key.encode() if api_key else None
        self.admin_key = admin_api_key.encode() if admin_api_key else None

    def required_key(self, path: str) -> bytes | None:
        if path in OPEN_PATHS:
            return None
        if path in ADMIN_PATHS and self.admin_key is not None:
            return self.admin_key
        return self.api_key

    def allows(self, path: str, authorization: str | None) -> bool:
        key = self.required_key(path)
        if key is None:
            return True
        scheme, _, given = (authorization or "").partition(" ")
        # compare_digest on bytes: the time taken does not depend on where the keys differ.
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key)


def unauthorized(path: str) -> APIError:
    what = "an admin API key" if path in ADMIN_PATHS else "an API key"
    return APIError(f"This endpoint needs {what}: send it as 'Authorization: Bearer <key>'.",
                    401, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class AuthMiddleware:
    """Plain ASGI middleware, not Starlette's BaseHTTPMiddleware (`@app.middleware`): that
    one relays every chunk of a streamed response through an in-memory stream between two
    tasks, which cost the ingress ~17% of its CPU under many streams. This one looks at the
    request's headers once and then gets out of the way."""

    def __init__(self, app, check: KeyCheck) -> None:
        self.app = app
        self.check = check

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            path = route_path(scope)
            if not self.check.allows(path, _header(scope, b"authorization")):
                await unauthorized(path).to_response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def install_auth(app: FastAPI) -> KeyCheck:
    """Check every request's key before routing; returns the KeyCheck to configure."""
    check = KeyCheck()
    app.add_middleware(AuthMiddleware, check=check)
    return check


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def route_path(scope) -> str:
    """The path below the app's route prefix (Serve passes the prefix as root_path)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path
