"""Tensor parallelism for an engine replica: ranks 1..tp-1 as Ray actors in the replica's
placement group, possibly on other nodes.

Serve reserves one bundle per rank (`placement_options`): bundle 0 holds the replica itself
(rank 0: scheduler, sampler and its slice of the model), bundles 1..tp-1 one worker actor
each. The placement group strategy decides whether ranks may cross nodes (STRICT_PACK: one
node; PACK or SPREAD: across nodes). Rank 0 opens the rendezvous on its node's IP and a free
port; the actors join it and run `engine.runtime.tp_worker.run_worker` on a thread, so they still
answer the replica's health pings.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine import EngineConfig

logger = logging.getLogger(__name__)

PING_TIMEOUT_S = 10.0


# -- deployment options ------------------------------------------------------------------------

def actor_resources(ray_actor_options: dict[str, Any]) -> dict[str, float]:
    """Ray actor options -> a resource dict (the form of a placement group bundle)."""
    res = {"CPU": ray_actor_options.get("num_cpus", 1), "GPU": ray_actor_options.get("num_gpus", 0),
           **ray_actor_options.get("resources", {})}
    if ray_actor_options.get("memory"):
        res["memory"] = ray_actor_options["memory"]
    return {k: v for k, v in res.items() if v}


def options_for(bundle: dict[str, float]) -> dict[str, Any]:
    """A resource dict -> Ray actor options that ask for exactly it."""
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
    options: dict[str, Any] = {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0),
                               "resources": custom}
    if bundle.get("memory"):
        options["memory"] = bundle["memory"]
    return options


def placement_options(ray_actor_options: dict[str, Any], tp_size: int, tp_bundle: dict[str, float],
                      strategy: str) -> dict[str, Any]:
    """Serve deployment options for a tp_size replica: every rank gets `tp_bundle` (its
    device: {"GPU": 1}, or a custom resource); rank 0, the replica, also its own
    `ray_actor_options`. The replica must ask for all of bundle 0, so that it lands there
    and sees its GPU."""
    rank0 = actor_resources(ray_actor_options)
    for key, value in tp_bundle.items():
        rank0[key] = max(rank0.get(key, 0), value)
    replica_options = {**ray_actor_options, **options_for(rank0)}
    return {"ray_actor_options": replica_options,
            "placement_group_bundles": [rank0] + [dict(tp_bundle) for _ in range(tp_size - 1)],
            "placement_group_strategy": strategy}


# -- the worker actors -----------------------------------------------------------------------

@ray.remote
class TPWorker:
    """One rank other than 0: `run_worker` on a thread; `ping` answers health checks."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: str | None = None

    def start(self, config: EngineConfig, rank: int, size: int, init_method: str) -> str:
        """Start the rank's step loop; returns the id of the node it runs on."""
        self._thread = threading.Thread(target=self._run, args=(config, rank, size, init_method),
                                        name=f"tp-rank-{rank}", daemon=True)
        self._thread.start()
        return ray.get_runtime_context().get_node_id()

    def _run(self, config: EngineConfig, rank: int, size: int, init_method: str) -> None:
        from engine import run_worker  # torch: in the rank's actor only

        try:
            run_worker(config, rank, size, init_method)
        except BaseException as e:  # noqa: BLE001 - reported through ping
            logger.exception("tensor-parallel rank %d failed", rank)
            self._error = f"{type(e).__name__}: {e}"

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def ping(self) -> bool:
        if self._error is not None:
            raise RuntimeError(f"tensor-parallel rank failed: {self._error}")
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("tensor-parallel rank's step loop has ended")
        return True


class TPWorkers:
    """Rank 0's handle on the other ranks of its replica; `tp` is rank 0's joined context."""

    def __init__(self, config: EngineConfig) -> None:
        from engine import init_tp, open_rendezvous, resolve_device  # torch: tp_size > 1 only

        pg = ray.util.get_current_placement_group()
        size = config.tp_size
        if pg is None or pg.bundle_count < size:
            raise RuntimeError(f"tp_size={size} needs the replica in a placement group of {size} "
                               "bundles (deployments.app sets placement_group_bundles)")
        rendezvous = open_rendezvous(ray.util.get_node_ip_address(), size, config.dist_timeout_s)
        device = resolve_device(config.device)
        # Each actor sees its own GPU(s) as cuda:0 (Ray sets CUDA_VISIBLE_DEVICES).
        worker_config = dataclasses.replace(config, device=device.type)
        self.actors = [
            TPWorker.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank),
                **options_for(pg.bundle_specs[rank])).remote()
            for rank in range(1, size)]
        try:
            starts = [a.start.remote(worker_config, rank, size, rendezvous.init_method)
                      for rank, a in enumerate(self.actors, start=1)]
            self.node_ids = [ray.get_runtime_context().get_node_id()]
            self.node_ids += ray.get(starts, timeout=config.dist_timeout_s)
            self.tp = init_tp(0, size, rendezvous, device, config.dist_timeout_s)
        except BaseException:
            self.close()
            raise
        logger.info("tensor parallel: %d ranks on nodes %s", size, self.node_ids)

    def check_health(self, timeout_s: float = PING_TIMEOUT_S) -> None:
        """Raise if a rank died or a collective failed: the process group is unusable then,
        so Serve should restart the replica (which starts fresh ranks)."""
        if self.tp.failure is not None:
            raise RuntimeError(f"tensor-parallel group failed: {self.tp.failure}")
        try:
            ray.get([a.ping.remote() for a in self.actors], timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - RayActorError, GetTimeoutError, ping's own
            error = RuntimeError(f"a tensor-parallel rank is down: {e}")
            # Requests until Serve replaces this replica fail at once instead of starting a
            # step the dead rank never joins; close() then sends it no shutdown message.
            self.tp.mark_failed(error)
            raise error from e

    def close(self, graceful: bool = True) -> None:
        """Tell the ranks to stop, then end their actors. Not graceful when the engine loop
        may still be inside a step: a shutdown message must not interleave with it."""
        tp = getattr(self, "tp", None)
        if tp is not None and graceful:
            tp.shutdown()
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
