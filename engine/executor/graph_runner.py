"""CUDA graphs for decode steps and short extend steps, captured at start-up and keyed by
`GraphKey(decode, bs, tokens)`; every graph reads one persistent batch of static buffers
(engine/executor/static_batch.py).

A decode step launches a few hundred small kernels, and so does a short prompt's prefill,
whose Python launch cost is several times its GPU time (most of a short prompt's time to
first token). Replaying a captured graph removes that cost. A step is padded up to the
nearest captured shape:
- decode: one graph per padded batch size (`capture_sizes`); padding rows are a dummy request
  (row 0, slot 0, length 1). The graph ends at the hidden states, the LM head runs after
  replay. With radix-grouped decode (`grouped=True`), the graphs of batch sizes >=
  `grouped_min_bs` are captured with the grouped attention kernels and read the step's
  group metadata (engine/core/prefix_groups.py, laid out for the padded size); a step without
  groups runs them with zero tiles (the plain decode plus an empty launch per layer).
- extend: one graph per (request capacity, token bucket), for steps of at most
  `max_extend_tokens` new tokens over at most `max_extend_bs` requests. Padding tokens write
  their K/V to slot 0 (the pool's padding slot); padding requests have no new tokens, so the
  extend kernel's programs for them exit at once (it reads every length from device tensors,
  so one graph serves any prefix length). A mixed step's decoders (one new token) are found
  on the device (`ForwardBatch.decoders_on_device`): the Triton backend attends for them with
  its decode kernel, wherever they sit in the step. The graph ends at the hidden states of
  every token; the rows that need logits are picked after replay (the last token of each
  request, every verified position of a speculative draft, prompt-logprob rows alike).
"""
from __future__ import annotations

import bisect
import logging
import time
from typing import NamedTuple

import torch

from engine.attention.base import ForwardBatch
from engine.executor.graph_capture import capture_graphs, run_each
from engine.executor.graph_inputs import compile_decode_inputs, write_decode_inputs
from engine.executor.startup_timer import format_seconds
from engine.executor.static_batch import StaticBatch

logger = logging.getLogger(__name__)

# 768 halves the padding of 513-768-token steps (H200, 8B dummy, TTFT: 513 tokens 17.7 ms
# in the 768 graph, 23.5 in the 1,024 one, 33-37 ms eager, where launching from Python
# takes twice the GPU time).
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 768, 1024, 2048)
BS_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class GraphKey(NamedTuple):
    decode: bool
    bs: int  # requests: a decode graph's padded batch, an extend graph's capacity
    tokens: int  # new tokens (a decode graph's: bs)


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s <= max_bs]


def _upto(buckets: tuple[int, ...], limit: int) -> list[int]:
    return [b for b in buckets if b <= limit]


class GraphRunner:
    def __init__(self, model, attn_backend, req_to_token: torch.Tensor, max_bs: int,
                 extend: tuple[int, int] | None = None, grouped: bool = False,
                 grouped_min_bs: int = 16) -> None:
        """Buffers only: `capture` (or engine/executor/graph_capture.capture_all) captures.
        `max_bs`: the largest decode batch; `extend`: (max new tokens, max requests) of
        the extend graphs, None for none (none either when no bucket fits)."""
        self.model = model
        self.attn_backend = attn_backend
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        max_tokens, max_reqs = extend or (0, 0)
        self.token_sizes = _upto(TOKEN_BUCKETS, max_tokens)
        self.bs_sizes = _upto(BS_BUCKETS, max_reqs)
        if not (self.token_sizes and self.bs_sizes):
            self.token_sizes, self.bs_sizes = [], []
        self.max_extend_tokens = self.token_sizes[-1] if self.token_sizes else 0
        self.max_extend_bs = self.bs_sizes[-1] if self.bs_sizes else 0
        self.static = StaticBatch(req_to_token, max(self.max_bs, self.max_extend_tokens),
                                  max(self.max_bs, self.max_extend_bs), self.max_bs)
        self.grouped_sizes = {s for s in self.sizes if grouped and s >= grouped_min_bs}
        self._decode_keys = [GraphKey(True, s, s) for s in self.sizes]
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}
        self.pool = None
        self.capture_times: dict[str, dict[str, float]] = {}
        self.decode_replays = 0  # steps run by replay (tests check the graphs were used)
        self.extend_replays = 0

    # -- shapes ------------------------------------------------------------------------------

    def extend_shapes(self) -> list[tuple[int, int]]:
        """(request capacity, token bucket) pairs: a bucket never smaller than its capacity."""
        return [(bs, t) for bs in self.bs_sizes for t in self.token_sizes if t >= bs]

    def keys(self, decode: bool) -> list[GraphKey]:
        """One kind's graphs in capture order: largest first (the others reuse its memory)."""
        if decode:
            return list(reversed(self._decode_keys))
        return [GraphKey(False, bs, t) for bs, t in reversed(self.extend_shapes())]

    def grouped_capacity(self, bs: int) -> int | None:
        """The padded size whose graph runs grouped decode for a batch of bs, or None."""
        if bs > self.max_bs:
            return None
        padded = self.sizes[bisect.bisect_left(self.sizes, bs)]
        return padded if padded in self.grouped_sizes else None

    # -- capture -----------------------------------------------------------------------------

    def _forward(self, key: GraphKey) -> torch.Tensor:
        """The captured part: the layers up to the final hidden states. A decode graph's LM
        head runs after replay: a graph's output stays allocated for the graph's life, and
        logits of every captured size would hold ~9 GB (fp32 x 128k vocab x ~18k rows)."""
        if key.decode:
            batch = self.static.decode_view(key.bs, key.bs in self.grouped_sizes)
        else:
            batch = self.static.extend_view(key.bs, key.tokens)
        self.attn_backend.prepare(batch)
        return self.model(batch)

    def _fill_dummy(self, key: GraphKey) -> None:
        if key.decode:
            self.static.fill_decode_dummy()
        else:
            self.static.fill_extend_dummy(key.tokens)

    def _compile_decode_inputs(self) -> None:
        """The graph-inputs kernel at every padded size (it runs outside the graphs, so a
        size first met in serving would compile it then)."""
        for bs in self.sizes:
            compile_decode_inputs(bs, self.static.req_to_token, self.static.decode_inputs)

    def run_keys(self) -> None:
        """Every graph's forward once, outside any graph (capture_all's deferred pass)."""
        run_each(self.keys(True), self._forward, self._fill_dummy)
        self._compile_decode_inputs()
        if self.token_sizes:
            run_each(self.keys(False), self._forward, self._fill_dummy)

    def _capture(self, decode: bool, warmups: int) -> dict[str, float]:
        captured = capture_graphs(self.keys(decode), self._forward, self.pool,
                                  prepare=self._fill_dummy, warmups=warmups)
        self.graphs.update(captured.graphs)
        self.outputs.update(captured.outputs)
        self.pool = captured.pool
        return captured.times

    def capture(self, warmups: int = 2) -> dict[str, dict[str, float]]:
        """Decode graphs, then extend graphs into the same memory pool; start-up times by
        kind."""
        times = {"decode_graphs": self._capture(True, warmups)}
        t0 = time.perf_counter()
        self._compile_decode_inputs()
        times["decode_graphs"]["graph_inputs"] = time.perf_counter() - t0
        logger.info("captured decode CUDA graphs for batch sizes %s (%s)", self.sizes,
                    format_seconds(times["decode_graphs"]))
        if self.token_sizes:
            times["extend_graphs"] = self._capture(False, warmups)
            logger.info("captured extend CUDA graphs for %d shapes (up to %d requests, %d "
                        "tokens; %s)", len(self.extend_shapes()), self.max_extend_bs,
                        self.max_extend_tokens, format_seconds(times["extend_graphs"]))
        self.capture_times = times
        return times

    # -- decode steps ------------------------------------------------------------------------

    def fits_decode(self, batch: ForwardBatch) -> bool:
        return batch.is_decode and batch.batch_size <= self.max_bs

    def run_decode(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [bs, vocab] of a decode batch: graph replay, then the LM head."""
        bs = batch.batch_size
        at = bisect.bisect_left(self.sizes, bs)
        padded = self.sizes[at]
        self.static.write_decode(batch, padded)
        pg = batch.prefix_groups
        if pg is not None:
            assert pg.cap == padded, "group metadata laid out for another capacity"
            self.static.write_groups(pg.packed)
        elif padded in self.grouped_sizes:
            self.static.clear_groups()
        return self._replay_decode(bs, at)

    def run_packed(self, flat: torch.Tensor, lengths: list[int],
                   pending_tokens: torch.Tensor | None) -> torch.Tensor:
        """`run_decode` for a decode step still packed (`flat` uploaded,
        engine/executor/step_input.py) whose fields `graph_inputs.takes_packed` accepts: one
        launch writes the static inputs, req_to_token's entries and the in-flight tokens,
        then the graph replays."""
        bs = lengths[0]
        at = bisect.bisect_left(self.sizes, bs)
        padded = self.sizes[at]
        write_decode_inputs(flat, lengths, pending_tokens, self.static.req_to_token,
                            self.static.decode_inputs, padded)
        if padded in self.grouped_sizes:
            self.static.clear_groups()
        return self._replay_decode(bs, at)

    def _replay_decode(self, bs: int, at: int) -> torch.Tensor:
        key = self._decode_keys[at]
        self.graphs[key].replay()
        self.decode_replays += 1
        return self.model.compute_logits(self.outputs[key][:bs])

    # -- extend steps ------------------------------------------------------------------------

    def fits_extend(self, batch: ForwardBatch) -> bool:
        bs = batch.batch_size
        return (not batch.is_decode and 0 < bs <= self.max_extend_bs
                and batch.num_tokens <= self.max_extend_tokens)

    def run_extend(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of the batch's new tokens, by graph replay: a
        view of the graph's output, valid until the next replay."""
        bs, n = batch.batch_size, batch.num_tokens
        cap = self.bs_sizes[bisect.bisect_left(self.bs_sizes, bs)]
        tokens = self.token_sizes[bisect.bisect_left(self.token_sizes, max(n, cap))]
        self.static.write_extend(batch, cap, tokens)
        key = GraphKey(False, cap, tokens)
        self.graphs[key].replay()
        self.extend_replays += 1
        return self.outputs[key][:n]
