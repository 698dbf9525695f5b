"""One step's batch as plain integers (`StepInput`): everything a rank needs to run the
step's forward. Rank 0 builds it (engine/executor/batch_builder.py) and packs it into one int64
host tensor (`PackedStep`); at tp > 1 it broadcasts exactly that, and every rank uploads
it in one copy and splits it back into the fields on the device. Packing and unpacking
follow the dataclass's fields, in the order declared."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from typing import Generic, TypeVar

import numpy as np
import torch

from engine.core.request import Request

V = TypeVar("V")  # list[int] while built on the host; a tensor once unpacked


@dataclass
class StepInput(Generic[V]):
    input_ids: V  # the new tokens of every chunk, back to back
    positions: V  # their sequence positions
    out_slots: V  # the KV slot each new token writes
    req_rows: V  # per chunk: its request's row of req_to_token
    seq_lens: V  # per chunk: the request's KV length after the step
    extend_lens: V  # per chunk: its number of new tokens
    qo_indptr: V  # prefix sums of extend_lens
    logits_indices: V  # token rows whose logits come back (samplers, draft verification)
    sync_rows: V  # req_to_token entries the step writes first: [row, col] = slot
    sync_cols: V
    sync_slots: V
    prompt_rows: V  # token rows whose logits score prompt tokens (prompt logprobs)
    prefix_groups: V  # radix-grouped decode metadata (engine/core/prefix_groups.py), or empty
    inflight_pos: V  # input positions whose token is still in flight (overlap scheduling)
    inflight_src: V  # where each of those is in the in-flight step's token tensor

    def pack(self, is_decode: bool) -> PackedStep:
        parts = [getattr(self, name) for name in FIELD_NAMES]
        # numpy reads the lists' ints in C: a mixed step of 8k tokens packs ~50k of them,
        # which torch.tensor of a flattened list took ~5x as long to do
        flat = np.fromiter(itertools.chain.from_iterable(parts), dtype=np.int64,
                           count=sum(map(len, parts)))
        flat = torch.from_numpy(flat)
        return PackedStep(flat, [len(p) for p in parts], is_decode, self.seq_lens,
                          self.extend_lens)

    @classmethod
    def unpack(cls, flat: torch.Tensor, lengths: list[int]) -> StepInput[torch.Tensor]:
        return cls(*flat.split(lengths))


FIELD_NAMES = tuple(f.name for f in fields(StepInput))


@dataclass
class PackedStep:
    """A StepInput's fields back to back in one int64 host tensor, with their lengths:
    what rank 0 sends the other ranks."""

    flat: torch.Tensor
    lengths: list[int]
    is_decode: bool
    seq_lens: list[int]  # host copies, read by the attention backend
    extend_lens: list[int]

    @classmethod
    def received(cls, flat: torch.Tensor, lengths: list[int], is_decode: bool) -> PackedStep:
        """A step as another rank receives it: the host copies read back from `flat`."""
        step = StepInput.unpack(flat, lengths)
        return cls(flat, lengths, is_decode, step.seq_lens.tolist(), step.extend_lens.tolist())

    def host(self, name: str) -> torch.Tensor:
        """One field, as a view of the host tensor."""
        i = FIELD_NAMES.index(name)
        start = sum(self.lengths[:i])
        return self.flat[start:start + self.lengths[i]]


@dataclass
class PendingTokens:
    """Tokens a launched step sampled that the host has not seen yet (overlap scheduling):
    `tokens` [k] on the device; `index[req]` is the request's entry in it. The next step
    reads a request's in-flight input token from there."""

    tokens: torch.Tensor
    index: dict[Request, int]
