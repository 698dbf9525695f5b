"""The attention backend interface and the per-step batch metadata it reads.

Layout (page size 1, as SGLang): every token of every request owns one KV slot. A running
request owns a row of `req_to_token` ([max_requests, max_context] int32) whose first
`seq_len` entries are the slots of its tokens in order (cached prefix first). A step's new
tokens ("extend" tokens: a prefill chunk, or one token per decoding request) are flattened
into one ragged batch of T tokens; `qo_indptr` cuts it per request.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class ForwardBatch:
    """Tensors (on the model's device) describing one forward step.

    T = total new tokens, B = number of requests in the step.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64: position of each new token in its sequence
    out_slots: torch.Tensor  # [T] int64: KV slot each new token's K/V is written to
    req_rows: torch.Tensor  # [B] int64: each request's row in req_to_token
    seq_lens: torch.Tensor  # [B] int32: tokens in KV after this step (prefix + new)
    extend_lens: torch.Tensor  # [B] int32: new tokens per request
    qo_indptr: torch.Tensor  # [B+1] int32: request i's new tokens are [qo_indptr[i], qo_indptr[i+1])
    # [R] int64: the rows of T whose logits the step needs (each request's last new token;
    # every position of a speculative draft); read after the forward, not by it
    logits_indices: torch.Tensor
    req_to_token: torch.Tensor  # [max_requests, max_context] int32, shared with the runner
    is_decode: bool  # every request has exactly one new token
    # Host-side copies, so backends can size grids / loop without a device sync.
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    # Radix-grouped decode (engine/prefix_group_batch.PrefixGroupBatch): requests sharing a
    # cached prefix attend over it once. None = plain decode; backends may ignore it.
    prefix_groups: Any = None
    # A mixed step (not is_decode): its first `decode_rows` requests have one new token each
    # (the scheduler puts decoders first), so a backend may attend for them with its decode
    # kernel and run the extend kernel on the rest only. 0 = every request through extend
    # (what a captured extend graph must assume). Set by `leading_decode_rows`.
    decode_rows: int = 0
    # A captured extend graph's step: the host cannot know which requests will decode when
    # it is replayed, so a backend that can finds them on the device (every request with
    # one new token, wherever it is) and attends for them as `decode_rows` would.
    decoders_on_device: bool = False

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu) if self.seq_lens_cpu else 0


def leading_decode_rows(extend_lens: list[int]) -> int:
    """How many requests at the front of a step have exactly one new token."""
    n = 0
    for e in extend_lens:
        if e != 1:
            break
        n += 1
    return n


class AttentionBackend(Protocol):
    """Writes the step's new K/V into the pool, then attends.

    `forward` gets q [T, Hq, D], k and v [T, Hkv, D] of the new tokens of layer
    `layer_id`, stores k/v at `batch.out_slots`, and returns [T, Hq, D]: each new token
    attends causally to its request's prefix and to the new tokens up to itself.
    """

    def prepare(self, batch: ForwardBatch) -> None:
        """Called once per step before the forward (per-step metadata, not per layer)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor: ...
