"""The Ray internals radixserve relies on are still where router/ray_adapter.py reads them.

A Ray upgrade that moves one fails here, naming it, rather than degrading quietly at run
time (the /v1/stats router counters vanish, draining replicas wait out their timeout,
sibling calls share one routing). No cluster needed.
"""
from __future__ import annotations

import pytest

pytest.importorskip("ray.serve")

from router import ray_adapter  # noqa: E402


def test_ray_internals_are_where_the_adapter_reads_them():
    missing = ray_adapter.missing_internals()
    assert not missing, ("Ray moved internals that router/ray_adapter.py uses; update the "
                         "adapter (and this Ray's version in docs):\n  " + "\n  ".join(missing))


def test_test_tooling_internal_is_there():
    """scripts/serve_replicas.py (tests and benchmarks, not shipped) builds Serve's request
    metadata by hand to call one particular replica."""
    try:
        from ray.serve._private.common import RequestMetadata

        RequestMetadata(request_id="r", internal_request_id="r", call_method="stats",
                        is_streaming=True)
    except (ImportError, TypeError) as e:
        pytest.fail(f"ray.serve._private.common.RequestMetadata(request_id, internal_request_id, "
                    f"call_method, is_streaming) moved or changed (scripts/serve_replicas.py "
                    f"uses it): {e!r}")


def test_missing_internal_is_named(monkeypatch):
    """The check itself can fail: a base class that no longer sets the attribute is named."""
    from ray.serve.request_router import RequestRouter

    def init(self, *args, **kwargs):  # sets none of the attributes the adapter reads
        pass

    monkeypatch.setattr(RequestRouter, "__init__", init)
    missing = ray_adapter.missing_internals()
    assert any("RequestRouter._deployment_id" in line for line in missing), missing
    assert any("RequestRouter._get_curr_time_s" in line for line in missing), missing


def test_router_state_through_the_adapter():
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from router.request_router import PrefixAwareRequestRouter

    router = PrefixAwareRequestRouter(
        deployment_id=DeploymentID(name="engine", app_name="app"),
        handle_source=DeploymentHandleSource.UNKNOWN, get_curr_time_s=lambda: 42.0)
    assert ray_adapter.router_deployment_name(router) == "engine"
    assert ray_adapter.router_clock(router)() == 42.0


def test_outside_serve_the_adapter_degrades():
    assert ray_adapter.replica_shutting_down() is False
    assert ray_adapter.handle_request_router(object()) is None
