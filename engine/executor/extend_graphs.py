"""CUDA graphs for small prefill/extend steps: one graph per (request capacity, token
bucket), captured at start-up.

A short prompt's prefill is launch-bound, not compute-bound: a 37-token step runs a few
hundred small kernels whose Python launch cost is several times their GPU time, and that
cost is most of a short prompt's time to first token. A step of at most `max_tokens` new
tokens over at most `max_bs` requests is padded up to the nearest captured shape and
replayed instead.

Padding: extra tokens write their K/V to slot 0 (the pool's padding slot) and their rows'
outputs are never read; extra requests have no new tokens, so the extend kernel's programs
for them exit at once (the kernel reads every length from device tensors, so one graph
serves any prefix length). A mixed step's decoders (one new token) are found on the device
too (`ForwardBatch.decoders_on_device`): the Triton backend attends for them with its decode
kernel, wherever they sit in the step. A graph ends at the hidden states of every token, and the rows
that need logits are picked after replay: the last token of each request, every verified
position of a speculative draft, prompt-logprob rows alike.
"""
from __future__ import annotations

import bisect
import logging

import torch

from engine.attention.base import ForwardBatch
from engine.executor.cuda_graph import capture_graphs, run_each
from engine.executor.startup_timer import format_seconds

logger = logging.getLogger(__name__)

# 768 halves the padding of 513-768-token steps (H200, 8B dummy, TTFT: 513 tokens 17.7 ms
# in the 768 graph, 23.5 in the 1,024 one, 33-37 ms eager, where launching from Python
# takes twice the GPU time).
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 768, 1024, 2048)
BS_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def _upto(buckets: tuple[int, ...], limit: int) -> list[int]:
    return [b for b in buckets if b <= limit]


class ExtendGraphs:
    """Graphs for extend steps of up to `max_tokens` new tokens and `max_bs` requests."""

    def __init__(self, model, attn_backend, req_to_token: torch.Tensor, max_tokens: int,
                 max_bs: int) -> None:
        """Buffers only: `capture` (or engine/cuda_graph.capture_all) captures."""
        self.model = model
        self.attn_backend = attn_backend
        self.req_to_token = req_to_token
        self.token_sizes = _upto(TOKEN_BUCKETS, max_tokens)
        self.bs_sizes = _upto(BS_BUCKETS, max_bs)
        if not self.token_sizes or not self.bs_sizes:
            raise ValueError(f"no extend graph fits max_tokens={max_tokens}, max_bs={max_bs}")
        self.max_tokens, self.max_bs = self.token_sizes[-1], self.bs_sizes[-1]
        dev = req_to_token.device
        t, b = self.max_tokens, self.max_bs
        self.input_ids = torch.zeros(t, dtype=torch.long, device=dev)
        self.positions = torch.zeros(t, dtype=torch.long, device=dev)
        self.out_slots = torch.zeros(t, dtype=torch.long, device=dev)
        self.req_rows = torch.zeros(b, dtype=torch.long, device=dev)
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=dev)
        self.extend_lens = torch.zeros(b, dtype=torch.int32, device=dev)
        self.qo_indptr = torch.zeros(b + 1, dtype=torch.int32, device=dev)
        self.no_rows = torch.zeros(0, dtype=torch.long, device=dev)  # the forward reads none
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = None
        self.capture_times: dict[str, float] = {}
        self.replays = 0  # steps run by replay (tests check the graphs were used)

    def shapes(self) -> list[tuple[int, int]]:
        """(request capacity, token bucket) pairs: a bucket never smaller than its capacity."""
        return [(bs, t) for bs in self.bs_sizes for t in self.token_sizes if t >= bs]

    def _batch(self, bs: int, tokens: int) -> ForwardBatch:
        # Host lengths as the backend sizes its grid: the bucket's token count for request 0.
        return ForwardBatch(
            input_ids=self.input_ids[:tokens], positions=self.positions[:tokens],
            out_slots=self.out_slots[:tokens], req_rows=self.req_rows[:bs],
            seq_lens=self.seq_lens[:bs], extend_lens=self.extend_lens[:bs],
            qo_indptr=self.qo_indptr[:bs + 1], logits_indices=self.no_rows,
            req_to_token=self.req_to_token, is_decode=False,
            seq_lens_cpu=[tokens] + [0] * (bs - 1), extend_lens_cpu=[tokens] + [0] * (bs - 1),
            decoders_on_device=bs > 1)  # (one request is a prefill: no empty decode launches)

    def _run(self, bs: int, tokens: int) -> torch.Tensor:
        batch = self._batch(bs, tokens)
        self.attn_backend.prepare(batch)
        return self.model(batch)  # hidden states; logits rows are picked after replay

    def _fill_dummy(self, tokens: int) -> None:
        """Capture inputs: request 0 extends `tokens` new tokens from row 0 / slot 0."""
        self.input_ids.zero_()
        self.positions.copy_(torch.arange(self.max_tokens, device=self.positions.device))
        self.out_slots.zero_()
        self.req_rows.zero_()
        self.seq_lens.zero_()
        self.extend_lens.zero_()
        self.seq_lens[0] = tokens
        self.extend_lens[0] = tokens
        self.qo_indptr.fill_(tokens)
        self.qo_indptr[0] = 0

    def _keys(self) -> list[tuple[int, int]]:
        return list(reversed(self.shapes()))

    def run_keys(self) -> None:
        run_each(self._keys(), lambda key: self._run(*key), lambda key: self._fill_dummy(key[1]))

    def capture(self, pool=None, warmups: int = 2):
        captured = capture_graphs(self._keys(), lambda key: self._run(*key), pool,
                                  prepare=lambda key: self._fill_dummy(key[1]), warmups=warmups)
        self.graphs, self.outputs, self.pool = captured.graphs, captured.outputs, captured.pool
        self.capture_times = captured.times
        logger.info("captured extend CUDA graphs for %d shapes (up to %d requests, %d tokens; %s)",
                    len(self.graphs), self.max_bs, self.max_tokens, format_seconds(captured.times))
        return self.pool

    def can_run(self, batch: ForwardBatch) -> bool:
        bs = batch.batch_size
        return not batch.is_decode and 0 < bs <= self.max_bs and batch.num_tokens <= self.max_tokens

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of the batch's new tokens, by graph replay: a
        view of the graph's output, valid until the next replay."""
        bs, n = batch.batch_size, batch.num_tokens
        cap = self.bs_sizes[bisect.bisect_left(self.bs_sizes, bs)]
        tokens = self.token_sizes[bisect.bisect_left(self.token_sizes, max(n, cap))]
        for name in ("input_ids", "positions", "out_slots"):
            buf = getattr(self, name)
            buf[:n].copy_(getattr(batch, name), non_blocking=True)
            buf[n:tokens].zero_()  # padding tokens: position 0, K/V into slot 0
        for name in ("req_rows", "seq_lens", "extend_lens"):
            buf = getattr(self, name)
            buf[:bs].copy_(getattr(batch, name), non_blocking=True)
            buf[bs:cap].zero_()  # padding requests: no new tokens
        self.qo_indptr[:bs + 1].copy_(batch.qo_indptr, non_blocking=True)
        self.qo_indptr[bs + 1:cap + 1].fill_(n)
        self.graphs[cap, tokens].replay()
        self.replays += 1
        return self.outputs[cap, tokens][:n]
