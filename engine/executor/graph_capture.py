"""Capturing CUDA graphs at start-up: each key's work run as warm-up, then captured into
one memory pool, with the Triton kernels the capture reaches compiled ahead in parallel
(engine/kernels/precompile.py). What is captured, and from which inputs, is the graph
runner's (engine/executor/graph_runner.py)."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.kernels.precompile import compile_ahead


@dataclass
class Captured:
    """capture_graphs' result: graphs and their output tensors by key, the shared memory pool,
    and where the capture's time went (seconds: warm-up runs, captures), which start-up
    reports."""

    graphs: dict
    outputs: dict
    pool: object
    times: dict[str, float] = field(default_factory=dict)


class Capturable(Protocol):
    """What capture_all needs of the graph runner (built above this module)."""

    def run_keys(self) -> None: ...

    def capture(self, warmups: int) -> dict: ...


@torch.inference_mode()
def run_each(keys: list, run: Callable, prepare: Callable = lambda key: None) -> None:
    """Every key's work once, outside any graph, on a side stream (capture_all's deferred
    pass)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for key in keys:
            prepare(key)
            run(key)
    torch.cuda.current_stream().wait_stream(stream)


def capture_all(graphs: Capturable, precompile: bool) -> dict:
    """Capture every graph of `graphs`. With `precompile`, first all their forwards once
    with Triton's compiles deferred (`run_keys`), and what they reached compiled in one
    parallel round; that pass also ran every torch op once, so one warm-up run per graph is
    enough (two without it). Returns start-up times: of the deferred pass and the compile,
    and the capture's own by graph kind."""
    times: dict = compile_ahead(graphs.run_keys, precompile)
    times.update(graphs.capture(warmups=1 if precompile else 2))
    return times


@torch.inference_mode()
def capture_graphs(keys: list, run: Callable, pool=None,
                   prepare: Callable = lambda key: None, warmups: int = 2) -> Captured:
    """One CUDA graph per key, in the order given (largest first: the others reuse its
    memory in the shared `pool`). `prepare(key)` sets the static inputs (outside the graph),
    `run(key)` is the captured work and returns its output tensor. `warmups` runs of each
    key first: Triton kernels compile and load, workspaces grow to size.

    Cached memory goes back to the driver once, before the first (largest) graph, not before
    every capture as `torch.cuda.graph` does: after each such release the next warm-up runs
    allocate all their tensors anew through cudaMalloc (vLLM skips the release after its first
    graph for the same reason). The capture is otherwise `torch.cuda.graph`'s: synchronize,
    then capture_begin/capture_end on the side stream."""
    out = Captured({}, {}, pool)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    warm_s = capture_s = 0.0
    with torch.cuda.stream(stream):
        for key in keys:
            t1 = time.perf_counter()
            prepare(key)
            for _ in range(warmups):
                run(key)
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            graph.capture_begin(pool=out.pool)
            try:
                out.outputs[key] = run(key)
            finally:
                graph.capture_end()
            if out.pool is None:
                out.pool = graph.pool()
            out.graphs[key] = graph
            warm_s += t2 - t1
            capture_s += time.perf_counter() - t2
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    out.times.update(warmup_runs=warm_s, captures=capture_s)
    return out
