"""CUDA graphs for decode steps: one graph per padded batch size, captured at start-up.

A decode step launches a few hundred small kernels; replaying a captured graph removes
their launch overhead. Each graph reads its inputs from static buffers; a step copies its
real inputs in and pads the rest with a harmless dummy request (row 0, slot 0, length 1).

With radix-grouped decode (`grouped=True`), the graphs of batch sizes >= `grouped_min_bs`
are captured with the grouped attention kernels and read the step's group metadata
(engine/core/prefix_groups.py, laid out for the padded size) from one more static buffer; a
step without groups runs them with zero tiles (the plain decode plus an empty launch per
layer). Smaller sizes keep the plain kernels.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
import logging
import time

import torch

from engine.attention.base import ForwardBatch
from engine.executor.graph_inputs import compile_decode_inputs, write_decode_inputs
from engine.kernels.precompile import compile_ahead
from engine.executor.prefix_group_batch import PrefixGroupBatch, packed_len
from engine.executor.startup_timer import format_seconds

logger = logging.getLogger(__name__)

# the per-step inputs a decode graph reads, in static buffers of these names
STATIC_INPUTS = ("input_ids", "positions", "out_slots", "req_rows", "seq_lens")


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s <= max_bs]


@dataclass
class Captured:
    """capture_graphs' result: graphs and their output tensors by key, the shared memory pool,
    and where the capture's time went (seconds: warm-up runs, captures), which start-up
    reports."""

    graphs: dict
    outputs: dict
    pool: object
    times: dict[str, float] = field(default_factory=dict)


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


def capture_all(graph_sets: list, precompile: bool) -> dict:
    """Capture each graph set (objects with `run_keys()` and `capture(pool, warmups)`, which
    returns the memory pool; decode graphs first, the rest reuse their pool). With
    `precompile`, first every set's forwards once with Triton's compiles deferred, and what
    they reached compiled in one parallel round (engine/kernels/precompile.py); that pass also ran
    every torch op once, so one warm-up run per graph is enough (two without it). Returns
    start-up times by set, and of the deferred pass and the compile."""
    times: dict = compile_ahead(lambda: [g.run_keys() for g in graph_sets], precompile)
    pool = None
    for g in graph_sets:
        pool = g.capture(pool, warmups=1 if precompile else 2)
        times[type(g).__name__] = g.capture_times
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


class DecodeGraphs:
    def __init__(self, model, attn_backend, req_to_token: torch.Tensor, max_bs: int,
                 grouped: bool = False, grouped_min_bs: int = 16) -> None:
        """Buffers only: `capture` (or engine/cuda_graph.capture_all) captures."""
        self.model = model
        self.attn_backend = attn_backend
        self.req_to_token = req_to_token
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        dev = req_to_token.device
        n = self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.out_slots = torch.zeros(n, dtype=torch.long, device=dev)
        self.req_rows = torch.zeros(n, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.extend_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.qo_indptr = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.logits_indices = torch.arange(n, dtype=torch.long, device=dev)
        self.grouped_sizes = {s for s in self.sizes if grouped and s >= grouped_min_bs}
        self.pfx_packed = torch.zeros(packed_len(n), dtype=torch.long, device=dev)
        self._pfx_empty = torch.zeros(packed_len(n), dtype=torch.long, device=dev)
        self._pfx_empty[1] = 1  # no tiles, one split
        self.pfx_packed.copy_(self._pfx_empty)
        self._pfx_dirty = False
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.capture_times: dict[str, float] = {}

    def _batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_slots=self.out_slots[:bs], req_rows=self.req_rows[:bs],
            seq_lens=self.seq_lens[:bs], extend_lens=self.extend_lens[:bs],
            qo_indptr=self.qo_indptr[:bs + 1], logits_indices=self.logits_indices[:bs],
            req_to_token=self.req_to_token, is_decode=True, seq_lens_cpu=[1] * bs,
            extend_lens_cpu=[1] * bs, prefix_groups=self._groups(bs))

    def _groups(self, bs: int) -> PrefixGroupBatch | None:
        if bs not in self.grouped_sizes:
            return None
        return PrefixGroupBatch(packed=self.pfx_packed[:packed_len(bs)], cap=bs, num_tiles=0,
                                num_splits=1, max_suffix=1)

    def grouped_capacity(self, bs: int) -> int | None:
        """The padded size whose graph runs grouped decode for a batch of bs, or None."""
        if bs > self.max_bs:
            return None
        padded = self.sizes[bisect.bisect_left(self.sizes, bs)]
        return padded if padded in self.grouped_sizes else None

    def _run(self, bs: int) -> torch.Tensor:
        """The captured part: the layers up to the final hidden states. The LM head runs
        after replay: a graph's output stays allocated for the graph's life, and logits of
        every captured size would hold ~9 GB (fp32 x 128k vocab x ~18k rows) for nothing."""
        batch = self._batch(bs)
        self.attn_backend.prepare(batch)
        return self.model(batch)

    def _keys(self) -> list[int]:
        return list(reversed(self.sizes))

    def _write_dummy_inputs(self) -> None:
        """The graph-inputs kernel at every padded size (it runs outside the graphs, so a
        size first met in serving would compile it then)."""
        statics = {name: getattr(self, name) for name in STATIC_INPUTS}
        for bs in self.sizes:
            compile_decode_inputs(bs, self.req_to_token, statics)

    def run_keys(self) -> None:
        run_each(self._keys(), self._run)
        self._write_dummy_inputs()

    def capture(self, pool=None, warmups: int = 2):
        captured = capture_graphs(self._keys(), self._run, pool, warmups=warmups)
        self.graphs, self.outputs, self.pool = captured.graphs, captured.outputs, captured.pool
        t0 = time.perf_counter()
        self._write_dummy_inputs()
        self.capture_times = dict(captured.times, graph_inputs=time.perf_counter() - t0)
        logger.info("captured decode CUDA graphs for batch sizes %s (%s)", self.sizes,
                    format_seconds(self.capture_times))
        return self.pool

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.is_decode and batch.batch_size <= self.max_bs

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [bs, vocab] of a decode batch: graph replay, then the LM head."""
        bs = batch.batch_size
        padded = self.sizes[bisect.bisect_left(self.sizes, bs)]
        for name in STATIC_INPUTS:
            getattr(self, name)[:bs].copy_(getattr(batch, name), non_blocking=True)
        if padded > bs:  # the dummy request: row 0, slot 0, one token
            self.input_ids[bs:padded].zero_()
            self.positions[bs:padded].zero_()
            self.out_slots[bs:padded].zero_()
            self.req_rows[bs:padded].zero_()
            self.seq_lens[bs:padded].fill_(1)
        pg = batch.prefix_groups
        if pg is not None:
            assert pg.cap == padded, "group metadata laid out for another capacity"
            self.pfx_packed[:pg.packed.numel()].copy_(pg.packed, non_blocking=True)
            self._pfx_dirty = True
        elif self._pfx_dirty and padded in self.grouped_sizes:
            self.pfx_packed.copy_(self._pfx_empty, non_blocking=True)
            self._pfx_dirty = False
        return self._replay(bs, padded)

    def run_packed(self, flat: torch.Tensor, lengths: list[int],
                   pending_tokens: torch.Tensor | None) -> torch.Tensor:
        """`run` for a decode step still packed (`flat` uploaded, engine/executor/step_input.py)
        whose fields `graph_inputs.takes_packed` accepts: one launch writes the static
        inputs, req_to_token's entries and the in-flight tokens, then the graph replays."""
        bs = lengths[0]
        padded = self.sizes[bisect.bisect_left(self.sizes, bs)]
        statics = {name: getattr(self, name) for name in STATIC_INPUTS}
        write_decode_inputs(flat, lengths, pending_tokens, self.req_to_token, statics, padded)
        if self._pfx_dirty and padded in self.grouped_sizes:
            self.pfx_packed.copy_(self._pfx_empty, non_blocking=True)
            self._pfx_dirty = False
        return self._replay(bs, padded)

    def _replay(self, bs: int, padded: int) -> torch.Tensor:
        self.graphs[padded].replay()
        return self.model.compute_logits(self.outputs[padded][:bs])
