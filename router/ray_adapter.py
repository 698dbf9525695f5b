"""Every use of Ray's non-public internals in radixserve, in this one module.

Ray Serve (2.60) has no public API for the few things below, so they reach into Ray's
private attributes and modules. Any Ray upgrade may move or rename them; keeping them
here means one file to fix, and `tests/test_ray_adapter.py` runs `missing_internals()`
so that an upgrade fails that test, naming each moved symbol, instead of silently
degrading (most callers here fall back quietly at run time, by design: a stats page or
a drain shortcut is not worth failing a request over).

It lives in router/ because both sides use it: the request router (router/ may import
only the standard library, msgpack and Ray) and the Serve deployments (deployments/
imports router/, never the other way). `tests/test_layering.py` allows underscore access
across modules only here.

What each internal is for:
- `router_deployment_name`, `router_clock`: state of Serve's `RequestRouter` base class
  our router reads (`_deployment_id`, `_get_curr_time_s`); the rest of what the router needs
  the base class offers publicly (`curr_replicas`).
- `handle_request_router`: the request router object inside a deployment handle
  (`handle._router._asyncio_router.request_router`, the path Ray's own LLM broadcast
  helper uses), for the router's counters in `/v1/stats`.
- `set_fresh_request_id`: a new Serve-internal request id for the current context
  (`serve.context._set_request_context`), so sibling handle calls are routed apart.
- `by_reference`: a handle whose calls are Ray actor calls, their results objects in Ray's
  object store (`options(_by_reference=True)`; the gRPC transport of Serve's
  high-throughput mode pickles results inline instead), for prefix KV between replicas.
- `replica_shutting_down`: whether Serve started this replica's graceful shutdown (the
  replica actor's `_replica_impl._shutting_down`), to end idle delta channels early.
- `peer_replica_alive`: whether another replica of this one's deployment is still alive in
  Ray's actor table: Serve names each replica actor by its full id (the controller's
  `ActorReplicaWrapper`), and Ray drops a dead actor's name at once; a prefix fetch from a
  dead holder gives up without waiting for its timeout.
"""
from __future__ import annotations

import inspect
import uuid
from collections.abc import Callable
from typing import Any

# -- the request router base class ----------------------------------------------------


def router_deployment_name(router: Any) -> str:
    """The name of the deployment a `RequestRouter` routes to."""
    return router._deployment_id.name


def router_clock(router: Any) -> Callable[[], float]:
    """The router's clock (`time.time` unless Serve, or a test, passed another)."""
    return router._get_curr_time_s


# -- deployment handles and request context -------------------------------------------


def handle_request_router(handle: Any) -> Any | None:
    """The request router object a deployment handle routes with, or None when this Ray
    keeps it elsewhere (or the handle has not routed anything yet)."""
    try:
        return handle._router._asyncio_router.request_router
    except AttributeError:
        return None


def set_fresh_request_id() -> None:
    """Give the current context (call in a copied one) its own Serve-internal request id."""
    from ray.serve import context as serve_context

    serve_context._set_request_context(_internal_request_id=uuid.uuid4().hex)


def by_reference(handle: Any) -> Any:
    """`handle` with its calls made as Ray actor calls: results go through the object store
    (pulled across nodes by Ray), whichever transport Serve uses by default."""
    return handle.options(_by_reference=True)


def replica_shutting_down() -> bool:
    """Has Serve started this replica's graceful shutdown? The replica actor sets
    `_shutting_down` on its implementation object when the controller asks it to stop,
    before waiting for ongoing requests. False wherever that cannot be read (outside
    Serve, or a Ray that moved it: then draining waits out graceful_shutdown_timeout_s)."""
    try:
        from ray._private import worker

        actor = worker.global_worker.actors.get(worker.global_worker.actor_id)
        return bool(actor._replica_impl._shutting_down)
    except Exception:  # noqa: BLE001 - see the docstring
        return False


def peer_replica_alive(unique_id: str) -> bool:
    """Is the replica `unique_id` of the calling replica's deployment alive? False only
    once Ray knows its actor is dead; True wherever that cannot be read (outside Serve)."""
    import ray
    from ray import serve
    from ray.serve.request_router import ReplicaID

    try:
        deployment = serve.get_replica_context().replica_id.deployment_id
    except Exception:  # noqa: BLE001 - not in a Serve replica
        return True
    name = ReplicaID(unique_id=unique_id, deployment_id=deployment).to_full_id_str()
    try:
        ray.get_actor(name, namespace="serve")
    except ValueError:  # no live actor of that name
        return False
    except Exception:  # noqa: BLE001 - the GCS unreachable for a moment: no verdict
        return True
    return True


# -- the check a Ray upgrade must pass ------------------------------------------------


def missing_internals() -> list[str]:
    """Every Ray internal above that this Ray no longer has, one line each naming it
    (empty when all are there). Checked statically: no Ray cluster needed."""
    problems: list[str] = []

    def need(what: str, check: Callable[[], bool]) -> None:
        try:
            ok = check()
        except Exception as e:  # noqa: BLE001 - an import or lookup that moved
            problems.append(f"{what}: {type(e).__name__}: {e}")
            return
        if not ok:
            problems.append(f"{what}: not found")

    def router_module():
        from ray.serve._private import router
        return router

    def replica_module():
        from ray.serve._private import replica
        return replica

    from ray.serve.request_router import RequestRouter

    for attr in ("_deployment_id", "_get_curr_time_s"):
        need(f"ray.serve.request_router.RequestRouter.{attr}",
             lambda attr=attr: _assigns(RequestRouter.__init__, attr))
    need("ray.serve.handle.DeploymentHandle._router",
         lambda: _assigns(_handle_base().__init__, "_router"))
    need("ray.serve._private.router.SingletonThreadRouter._asyncio_router",
         lambda: _assigns(router_module().SingletonThreadRouter.__init__, "_asyncio_router"))
    need("ray.serve._private.router.AsyncioRouter.request_router",
         lambda: isinstance(router_module().AsyncioRouter.request_router, property))
    need("ray.serve.context._set_request_context(_internal_request_id=...)",
         lambda: "_internal_request_id" in _params(_request_context_setter()))
    need("ray.serve.handle.DeploymentHandle.options(_by_reference=...)",
         lambda: "_by_reference" in _params(_handle_base_options()))
    need("ray._private.worker.global_worker.actors / .actor_id", _worker_has_actors)
    need("ray.serve._private.replica.ReplicaActor._replica_impl",
         lambda: _assigns(replica_module().ReplicaActor.__init__, "_replica_impl"))
    need("ray.serve._private.replica.Replica._shutting_down",
         lambda: _assigns(replica_module().Replica.__init__, "_shutting_down"))
    need("replica actors named ReplicaID.to_full_id_str() in namespace 'serve'",
         _replica_actor_naming)
    return problems


def _assigns(function: Callable, attr: str) -> bool:
    """Does `function`'s source set `self.<attr>` (an instance attribute, which only the
    source shows without building the object)?"""
    source = inspect.getsource(function)
    return f"self.{attr} =" in source or f"self.{attr}:" in source


def _replica_actor_naming() -> bool:
    from ray.serve._private import constants, deployment_state

    source = inspect.getsource(deployment_state.ActorReplicaWrapper.__init__)
    return ("self._actor_name = replica_id.to_full_id_str()" in source
            and constants.SERVE_NAMESPACE == "serve")


def _params(function: Callable) -> set[str]:
    return set(inspect.signature(function).parameters)


def _handle_base() -> type:
    from ray.serve.handle import DeploymentHandle

    # The attribute is set in whichever base class defines __init__.
    return next(c for c in DeploymentHandle.__mro__ if "__init__" in vars(c))


def _handle_base_options() -> Callable:
    from ray.serve.handle import DeploymentHandle

    return DeploymentHandle.options


def _request_context_setter() -> Callable:
    from ray.serve import context as serve_context

    return serve_context._set_request_context


def _worker_has_actors() -> bool:
    from ray._private import worker

    global_worker = worker.global_worker
    return hasattr(global_worker, "actors") and hasattr(type(global_worker), "actor_id")
