"""The LoRA adapters an app loaded and unloaded at runtime, kept where they outlive every
engine replica, so that a replica that starts later (autoscaling, a restart after a crash)
serves the same adapters as those that saw the loads.

`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (deployments/lora_api.py) record
each change here before they broadcast it to the running replicas; an engine replica
applies the record once its engine is built, before its constructor returns, which is when
Serve starts routing to it (`restore_adapters`). A replica that starts while a load is being
broadcast thus has the adapter either way.

Where the record lives: a named, detached Ray actor per Serve app (`AdapterRegistry`).
- Not a replica's own actor: Ray ends an actor with the worker that owns it, so a record
  owned by a replica would die with it (the case this exists for); detached, it has no owner.
- Not Serve's state: the controller keeps no state that an app's code can write, and the
  GCS key-value store is a Ray internal.
- Not the other replicas' memory: when every replica restarts (one replica, or a node lost)
  nobody would remember.
A detached actor must end itself: it watches Serve's status and leaves once its app is being
deleted or gone. A redeploy of the app (a config update) keeps it, and the adapters with it.
A registry left by an app deleted and deployed again faster than `WATCH_PERIOD_S` would
carry its adapters over; Serve's delete takes seconds, so the watch sees it.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine import EngineClient

logger = logging.getLogger(__name__)

NAMESPACE = "radixserve"
WATCH_PERIOD_S = 1.0
UNLOADED = None  # the record of a start-up adapter (`lora_modules`) unloaded at runtime


class AdapterRegistry:
    """The record of one app (a Ray actor: `registry_for`): adapter name -> PEFT folder, or
    UNLOADED for an adapter of the app args that was unloaded at runtime."""

    def __init__(self, app: str, watch_period_s: float = WATCH_PERIOD_S) -> None:
        self.app = app
        self.entries: dict[str, str | None] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, args=(watch_period_s,), daemon=True,
                         name="lora-registry-watch").start()

    def record(self, name: str, path: str | None) -> tuple[bool, str | None]:
        """Record `name` as loaded from `path` (or UNLOADED); (had an entry, the old one),
        for `put_back` when the change fails."""
        with self._lock:
            had, old = name in self.entries, self.entries.get(name)
            self.entries[name] = path
            return had, old

    def put_back(self, name: str, had: bool, old: str | None) -> None:
        with self._lock:
            if had:
                self.entries[name] = old
            else:
                self.entries.pop(name, None)

    def snapshot(self) -> dict[str, str | None]:
        with self._lock:
            return dict(self.entries)

    def _watch(self, period_s: float) -> None:
        from ray import serve

        while True:
            time.sleep(period_s)
            try:
                app = serve.status().applications.get(self.app)
            except Exception:  # noqa: BLE001 - the controller restarting: look again later
                continue
            if app is None or app.status == "DELETING":
                logger.info("app %s is gone: its LoRA registry ends", self.app)
                _end_this_actor()
                return


def _end_this_actor() -> None:
    import ray

    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


def registry_name(app: str) -> str:
    return f"lora-registry:{app}"


def registry_for(app: str) -> Any:
    """The app's registry actor, created by the first caller."""
    import ray

    actor = ray.remote(AdapterRegistry).options(
        name=registry_name(app), namespace=NAMESPACE, lifetime="detached",
        get_if_exists=True, num_cpus=0, max_restarts=0)
    return actor.remote(app)


def this_app() -> str | None:
    """The Serve app of the calling replica; None outside Serve."""
    try:
        from ray import serve

        return serve.get_replica_context().app_name
    except Exception:  # noqa: BLE001 - not in a Serve replica (unit tests, benchmarks)
        return None


class AppAdapters:
    """The ingress's side: record a load or unload before it is broadcast, and take the
    record back when every replica refused it."""

    def __init__(self) -> None:
        self._registry: Any = None
        self._looked_up = False

    def _actor(self) -> Any:
        if not self._looked_up:
            app = this_app()
            self._registry = registry_for(app) if app is not None else None
            self._looked_up = True
        return self._registry

    async def record(self, name: str, path: str | None) -> tuple[bool, str | None] | None:
        actor = self._actor()
        return None if actor is None else await actor.record.remote(name, path)

    async def put_back(self, name: str, previous: tuple[bool, str | None] | None) -> None:
        actor = self._actor()
        if actor is not None and previous is not None:
            await actor.put_back.remote(name, *previous)


def restore_adapters(engine: EngineClient, timeout_s: float = 120.0) -> dict[str, str | None]:
    """Apply the app's record to this replica's new engine (from its constructor, before it
    takes requests): load each adapter loaded at runtime, unload each start-up adapter
    unloaded at runtime. An adapter that no longer loads (its folder gone) is logged and
    skipped: the replica answers 404 for it, as for any unknown name. Returns the record."""
    app = this_app()
    if app is None or not engine.config.lora_enabled:
        return {}
    import ray

    try:  # (made by the first load or unload: an app that had none has no registry)
        registry = ray.get_actor(registry_name(app), namespace=NAMESPACE)
    except ValueError:
        return {}
    record = ray.get(registry.snapshot.remote(), timeout=timeout_s)
    if record:
        # (the constructor may run on Serve's event loop, which it blocks: a loop of its own)
        with ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, _apply(engine, record)).result(timeout_s)
    return record


class RestoredLoads:
    """The loads a replica applied from the record at its start. The broadcast of one of
    them may still be on its way (the replica started while it was sent): that broadcast
    is acknowledged once, as done, rather than refused as "already loaded", which would
    fail the client's load. Any later operation on the name forgets it."""

    def __init__(self, record: dict[str, str | None]) -> None:
        self.loads = {name: path for name, path in record.items() if path is not UNLOADED}

    def acknowledges(self, op: str, args: tuple[str, ...]) -> bool:
        path = self.loads.pop(args[0], None) if args else None
        return op == "load_lora" and path is not None and tuple(args[1:2]) == (path,)


async def _apply(engine: EngineClient, record: dict[str, str | None]) -> None:
    have = {a["name"] for a in await engine.list_loras()}
    for name, path in record.items():
        try:
            if name in have:  # a start-up adapter, unloaded or loaded from elsewhere since
                await engine.unload_lora(name)
            if path is not UNLOADED:
                await engine.load_lora(name, path)
        except Exception as e:  # noqa: BLE001 - see restore_adapters
            logger.warning("LoRA adapter %r (%s) from the app's registry: %s", name, path, e)
    logger.info("LoRA adapters from the app's registry: %s", record)
