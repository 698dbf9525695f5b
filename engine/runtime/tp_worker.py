"""Tensor-parallel ranks 1..tp-1: each loads its slices of the model and runs the steps rank 0
sends, in lock step with it. Rank 0 (the `Engine`) schedules and samples.

`run_worker` is a rank's whole life (its own process here, or a Ray actor's thread in
deployments/tp_workers.py). `LocalWorkers` starts ranks 1..tp-1 as local processes for the
offline `LLM` and makes sure none outlives it.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import time

import torch
import torch.multiprocessing as mp

from engine.config import EngineConfig
from engine.executor.distributed import CMD_SHUTDOWN, DistributedTP, init_tp, open_rendezvous
from engine.runtime.gc_freeze import freeze_after_start
from engine.executor.model_runner import ModelRunner
from engine.loading.hf_config import resolve_device
from engine.models import load_model

logger = logging.getLogger(__name__)


def run_worker(config: EngineConfig, rank: int, size: int, init_method: str) -> int:
    """Join rank 0's process group at `init_method`, build this rank's ModelRunner and run
    steps until rank 0 says shutdown. Returns the number of steps run."""
    tp = init_tp(rank, size, init_method, resolve_device(config.device), config.dist_timeout_s)
    try:
        runner = ModelRunner(config, tp=tp, load_model=load_model)
        freeze_after_start(runner, config.freeze_gc_after_start)
        return serve_steps(runner, tp)
    finally:
        tp.shutdown()


def serve_steps(runner: ModelRunner, tp: DistributedTP) -> int:
    steps = 0
    while True:
        msg = tp.recv_step()
        if msg.command == CMD_SHUTDOWN:
            return steps
        runner.execute(msg.step)
        steps += 1


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config of one local rank: on GPUs, rank r takes the r-th GPU after rank 0's."""
    device = resolve_device(config.device)
    if device.type != "cuda":
        return config
    base = device.index if device.index is not None else 0
    return dataclasses.replace(config, device=f"cuda:{base + rank}")


class LocalWorkers:
    """Ranks 1..tp-1 as local processes; `tp` is rank 0's joined context."""

    def __init__(self, config: EngineConfig) -> None:
        size = config.tp_size
        rendezvous = open_rendezvous("127.0.0.1", size, config.dist_timeout_s)
        # spawn, not fork: the parent may already hold CUDA state or threads.
        ctx = mp.get_context("spawn")
        self._started = [ctx.Event() for _ in range(1, size)]
        self.procs = [ctx.Process(target=_local_worker_main, name=f"tp-rank-{rank}", daemon=True,
                                  args=(rank_config(config, rank), rank, size,
                                        rendezvous.init_method, os.getpid(), started))
                      for rank, started in zip(range(1, size), self._started)]
        for p in self.procs:
            p.start()
        atexit.register(self.close)
        try:
            self._wait_started(config.dist_timeout_s)
            self.tp = init_tp(0, size, rendezvous, resolve_device(rank_config(config, 0).device),
                              config.dist_timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait_started(self, timeout_s: float) -> None:
        """Until every rank's process is running its code: one that dies first (a script
        without a main guard, an import error) fails here at once, not after the
        rendezvous timeout."""
        deadline = time.monotonic() + timeout_s
        while not all(e.is_set() for e in self._started):
            for rank, p in enumerate(self.procs, start=1):
                if p.exitcode is not None and not self._started[rank - 1].is_set():
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} exited with code {p.exitcode} before it "
                        "started (its error is printed above). The ranks are started with "
                        "multiprocessing's spawn, which re-imports the main module: a script "
                        "that creates LLM(tp_size=...) needs an `if __name__ == \"__main__\":` "
                        "guard.")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks did not start within {timeout_s} s")
            time.sleep(0.05)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the ranks: ask nicely (shutdown step), then terminate, then kill."""
        atexit.unregister(self.close)
        tp = getattr(self, "tp", None)
        if tp is not None:
            tp.shutdown()
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(2)
            if p.is_alive():
                p.kill()
                p.join(2)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


def _local_worker_main(config: EngineConfig, rank: int, size: int, init_method: str,
                       parent_pid: int, started) -> None:
    started.set()
    _exit_with_parent(parent_pid)
    if resolve_device(config.device).type == "cpu":
        # The ranks share the machine's cores: oversubscribing them slows every rank.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    run_worker(config, rank, size, init_method)


def _exit_with_parent(parent_pid: int) -> None:
    """Daemon processes die with a parent that exits normally, not with one that is killed:
    then this process is re-parented, which we notice here."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
