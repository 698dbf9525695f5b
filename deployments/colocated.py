"""`ingress: colocated`: one deployment that is both the OpenAI HTTP ingress and the engine.

Split (the default): HTTP -> an ingress replica -> Serve's router and a gRPC call -> the
engine replica, whose deltas come back on a delta channel. Colocated: HTTP -> the engine
replica's own FastAPI app -> its engine, in the same process. Traced on one H200 (8B
model, `scripts/serve.sh`'s mode; benchmarks/history.md), the router, the
gRPC hop and the channel were ~3.2 ms of a request's ~8 ms outside the engine.

What it gives up: prefix-aware routing between engine replicas (HTTP reaches a replica
through Serve's proxy or HAProxy, which balance by load), and the ingress replicas' CPUs:
one process tokenizes, decodes and frames SSE for all of its streams beside the engine
(`engine_process: true` moves the engine's step loop to a child process with its own GIL).
So it suits one replica per node and latency-bound traffic, not hundreds of streams.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from deployments.engine_replica import EngineReplica
from deployments.ingress import OpenAIIngress

logger = logging.getLogger(__name__)


class LocalStream:
    """A streamed call's response, as a Serve handle returns it: iterate it, or `cancel()`."""

    def __init__(self, items: AsyncIterator) -> None:
        self._items = items

    def __aiter__(self) -> LocalStream:
        return self

    async def __anext__(self) -> Any:
        return await self._items.__anext__()

    def cancel(self) -> None:
        """End the call. A call still being iterated ends with its consumer task's
        cancellation (the engine aborts in the generator's `finally`); one paused between
        items is closed here."""
        if not self._items.ag_running:
            with contextlib.suppress(RuntimeError):
                asyncio.ensure_future(self._items.aclose())


class _Method:
    def __init__(self, fn: Callable) -> None:
        self._fn = fn

    def remote(self, *args: Any) -> Any:
        result = self._fn(*args)
        return LocalStream(result) if hasattr(result, "__anext__") else result


class _Broadcast:
    """A broadcast's response, as Serve's: `call()` answers one replica's result, or (`many`)
    a list of them."""

    def __init__(self, call: Callable, many: bool = False) -> None:
        self._call = call
        self._many = many

    async def results_async(self, timeout_s: float | None = None, return_exceptions: bool = False):
        try:
            result = await asyncio.wait_for(self._call(), timeout_s)
            return result if self._many else [result]
        except Exception as e:  # noqa: BLE001 - as Serve's broadcast reports a replica's failure
            if return_exceptions:
                return [e]
            raise


class LocalEngineHandle:
    """The part of a DeploymentHandle to EngineReplica that OpenAIIngress uses, answered by
    an EngineReplica in this process: no router, no serialization, no delta channel
    (`in_process` tells the ingress to stream each call's deltas on its own iterator)."""

    in_process = True

    def __init__(self, replica: EngineReplica | None) -> None:
        self.replica = replica  # None until built: the ingress only keeps the handle meanwhile

    def options(self, **_: Any) -> LocalEngineHandle:
        return self

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(getattr(self.replica, name))

    def broadcast(self, method: str, *args: Any) -> _Broadcast:
        return _Broadcast(functools.partial(getattr(self.replica, method), *args))


class PeerEngines:
    """Broadcasts to the engines of every replica of this deployment, so that a LoRA adapter
    loaded through one replica's HTTP reaches them all: through a handle to the deployment
    (made on first use: a replica's context exists once Serve runs its constructor), and to
    this replica directly when that handle did not reach it (a handle learns of replicas
    from the controller's broadcasts, a moment behind a start). Outside Serve, this
    replica alone. The method must answer a dict naming its "replica"."""

    def __init__(self, local: LocalEngineHandle) -> None:
        self.local = local
        self._peers: Any | None = None

    def broadcast(self, method: str, *args: Any) -> _Broadcast:
        return _Broadcast(functools.partial(self._everywhere, method, *args), many=True)

    async def _everywhere(self, method: str, *args: Any) -> list:
        peers = self._peer_handle()
        results: list = []
        if peers is not None:
            try:
                results = await peers.broadcast(method, *args).results_async(
                    return_exceptions=True)
            except Exception as e:  # noqa: BLE001 - e.g. no replica known yet: this one still is
                logger.warning("%s broadcast to the deployment failed: %r", method, e)
                results = []
        own = self.local.replica.replica_id
        if not any(isinstance(r, dict) and r.get("replica") == own for r in results):
            results.append(await getattr(self.local.replica, method)(*args))
        return results

    def _peer_handle(self) -> Any | None:
        if self._peers is None:
            try:
                from ray import serve

                context = serve.get_replica_context()
                self._peers = serve.get_deployment_handle(context.deployment, context.app_name)
            except Exception:  # noqa: BLE001 - not inside Serve
                return None
        return self._peers


def import_both_halves() -> None:
    """The engine's and the tokenizer's imports (torch, Triton, transformers), here, before
    the two halves build on two threads: one thread importing a package while another
    imports it too can deadlock where the package's modules import each other."""
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401

    from engine import AsyncEngine, Engine, ProcessAsyncEngine  # noqa: F401


class EngineIngress(OpenAIIngress):
    """Serve deployment class of `ingress: colocated` (wrapped in `app.py`): the OpenAI
    API of deployments/ingress.py over an EngineReplica built in this replica."""

    async def __init__(self, model: str | None, engine_kwargs: dict[str, Any],
                       gil_switch_interval_ms: float | None, engine_process: bool,
                       served_model_name: str, **ingress_kwargs: Any) -> None:
        # The engine builds on a thread while the ingress half (tokenizer, model config, chat
        # features) loads on this replica's event loop: start-up takes the longer of the two,
        # not their sum. Serve routes nothing here before both are done.
        import_both_halves()
        handle = LocalEngineHandle(None)
        build = asyncio.get_running_loop().run_in_executor(None, functools.partial(
            EngineReplica, model, engine_kwargs, gil_switch_interval_ms=gil_switch_interval_ms,
            engine_process=engine_process))
        try:
            await super().__init__(handle, model, served_model_name, **ingress_kwargs)
        finally:
            self.replica = handle.replica = await build
        self.lora_api.configure(PeerEngines(handle))

    async def lora_admin(self, op: str, *args: str) -> dict[str, Any]:
        """This replica's part of a LoRA load/unload/list broadcast (PeerEngines)."""
        return await self.replica.lora_admin(op, *args)

    def check_health(self) -> None:
        self.replica.check_health()

    async def metrics_snapshot(self) -> dict:
        """Both roles of this replica for /metrics: its engine's and its ingress's."""
        return {**await self.replica.metrics_snapshot(), **await super().metrics_snapshot()}

    def tp_info(self) -> dict[str, Any]:
        """Where this replica's tensor-parallel ranks run (EngineReplica.tp_info)."""
        return self.replica.tp_info()
