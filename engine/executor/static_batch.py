"""The persistent device batch every CUDA graph reads: one set of static buffers that the
decode and the extend graphs share (engine/executor/graph_runner.py). A step copies its
inputs in before its graph replays and pads the rest with harmless rows.

Shared: input_ids, positions, out_slots (sized for the most tokens of either kind) and
req_rows, seq_lens (for the most requests). Each replay rewrites all of these that its graph
reads. Extend graphs also read extend_lens and qo_indptr, which every extend replay
rewrites; a decode graph reads its own constant copies instead (all ones, 0..bs), never
written after allocation, so a decode step costs no launch for them (LongRoPE reads
extend_lens in a decode forward: engine/layers/longrope.py). The radix-grouped decode
metadata (engine/core/prefix_groups.py) is a decode graph's alone.
"""
from __future__ import annotations

import torch

from engine.attention.base import ForwardBatch
from engine.executor.prefix_group_batch import PrefixGroupBatch, packed_len

# the per-step inputs a decode graph reads from the shared buffers, by name
DECODE_INPUTS = ("input_ids", "positions", "out_slots", "req_rows", "seq_lens")


class StaticBatch:
    def __init__(self, req_to_token: torch.Tensor, max_tokens: int, max_reqs: int,
                 decode_bs: int) -> None:
        """Buffers for steps of up to `max_tokens` new tokens over `max_reqs` requests, and
        decode steps of up to `decode_bs` requests."""
        self.req_to_token = req_to_token
        long = {"dtype": torch.long, "device": req_to_token.device}
        i32 = {"dtype": torch.int32, "device": req_to_token.device}
        self.input_ids = torch.zeros(max_tokens, **long)
        self.positions = torch.zeros(max_tokens, **long)
        self.out_slots = torch.zeros(max_tokens, **long)
        self.req_rows = torch.zeros(max_reqs, **long)
        self.seq_lens = torch.ones(max_reqs, **i32)
        self.extend_lens = torch.zeros(max_reqs, **i32)
        self.qo_indptr = torch.zeros(max_reqs + 1, **i32)
        self.decode_extend_lens = torch.ones(decode_bs, **i32)
        self.decode_qo_indptr = torch.arange(decode_bs + 1, **i32)
        self.decode_logits_indices = torch.arange(decode_bs, **long)
        self.no_rows = torch.zeros(0, **long)  # an extend graph picks its logits rows after
        self.decode_inputs = {name: getattr(self, name) for name in DECODE_INPUTS}
        self.pfx_packed = torch.zeros(packed_len(decode_bs), **long)
        self._pfx_empty = torch.zeros(packed_len(decode_bs), **long)
        self._pfx_empty[1] = 1  # no tiles, one split
        self.pfx_packed.copy_(self._pfx_empty)
        self._pfx_dirty = False

    # -- the views a graph is captured on --------------------------------------------------

    def decode_view(self, bs: int, grouped: bool) -> ForwardBatch:
        """A decode graph's batch of `bs` requests (`grouped`: with the group metadata)."""
        groups = None
        if grouped:
            groups = PrefixGroupBatch(packed=self.pfx_packed[:packed_len(bs)], cap=bs,
                                      num_tiles=0, num_splits=1, max_suffix=1)
        return ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_slots=self.out_slots[:bs], req_rows=self.req_rows[:bs],
            seq_lens=self.seq_lens[:bs], extend_lens=self.decode_extend_lens[:bs],
            qo_indptr=self.decode_qo_indptr[:bs + 1],
            logits_indices=self.decode_logits_indices[:bs], req_to_token=self.req_to_token,
            is_decode=True, seq_lens_cpu=[1] * bs, extend_lens_cpu=[1] * bs,
            prefix_groups=groups)

    def extend_view(self, bs: int, tokens: int) -> ForwardBatch:
        """An extend graph's batch: `tokens` new tokens over a capacity of `bs` requests."""
        # Host lengths as the backend sizes its grid: the bucket's token count for request 0.
        return ForwardBatch(
            input_ids=self.input_ids[:tokens], positions=self.positions[:tokens],
            out_slots=self.out_slots[:tokens], req_rows=self.req_rows[:bs],
            seq_lens=self.seq_lens[:bs], extend_lens=self.extend_lens[:bs],
            qo_indptr=self.qo_indptr[:bs + 1], logits_indices=self.no_rows,
            req_to_token=self.req_to_token, is_decode=False,
            seq_lens_cpu=[tokens] + [0] * (bs - 1), extend_lens_cpu=[tokens] + [0] * (bs - 1),
            decoders_on_device=bs > 1)  # (one request is a prefill: no empty decode launches)

    # -- capture inputs ----------------------------------------------------------------------

    def fill_decode_dummy(self) -> None:
        """Capture inputs of a decode graph: every request is the dummy (row 0, slot 0,
        length 1)."""
        for name in ("input_ids", "positions", "out_slots", "req_rows"):
            getattr(self, name).zero_()
        self.seq_lens.fill_(1)

    def fill_extend_dummy(self, tokens: int) -> None:
        """Capture inputs of an extend graph: request 0 extends `tokens` new tokens from
        row 0 / slot 0, the other requests have none."""
        self.input_ids.zero_()
        self.positions.zero_()
        self.positions[:tokens].copy_(torch.arange(tokens, device=self.positions.device))
        self.out_slots.zero_()
        self.req_rows.zero_()
        self.seq_lens.zero_()
        self.extend_lens.zero_()
        self.seq_lens[0] = tokens
        self.extend_lens[0] = tokens
        self.qo_indptr.fill_(tokens)
        self.qo_indptr[0] = 0

    # -- per step ----------------------------------------------------------------------------

    def write_decode(self, batch: ForwardBatch, padded: int) -> None:
        """A decode step's inputs, padded to `padded` rows with the dummy request (row 0,
        slot 0, one token)."""
        bs = batch.batch_size
        for name in DECODE_INPUTS:
            getattr(self, name)[:bs].copy_(getattr(batch, name), non_blocking=True)
        if padded > bs:
            self.input_ids[bs:padded].zero_()
            self.positions[bs:padded].zero_()
            self.out_slots[bs:padded].zero_()
            self.req_rows[bs:padded].zero_()
            self.seq_lens[bs:padded].fill_(1)

    def write_extend(self, batch: ForwardBatch, cap: int, tokens: int) -> None:
        """An extend step's inputs, padded to `tokens` tokens (position 0, K/V into slot 0)
        and `cap` requests (no new tokens)."""
        bs, n = batch.batch_size, batch.num_tokens
        for name in ("input_ids", "positions", "out_slots"):
            buf = getattr(self, name)
            buf[:n].copy_(getattr(batch, name), non_blocking=True)
            buf[n:tokens].zero_()
        for name in ("req_rows", "seq_lens", "extend_lens"):
            buf = getattr(self, name)
            buf[:bs].copy_(getattr(batch, name), non_blocking=True)
            buf[bs:cap].zero_()
        self.qo_indptr[:bs + 1].copy_(batch.qo_indptr, non_blocking=True)
        self.qo_indptr[bs + 1:cap + 1].fill_(n)

    def write_groups(self, packed: torch.Tensor) -> None:
        """A grouped decode step's metadata (laid out for its graph's padded size)."""
        self.pfx_packed[:packed.numel()].copy_(packed, non_blocking=True)
        self._pfx_dirty = True

    def clear_groups(self) -> None:
        """No groups this step: a grouped graph then runs zero tiles."""
        if self._pfx_dirty:
            self.pfx_packed.copy_(self._pfx_empty, non_blocking=True)
            self._pfx_dirty = False
