"""A pooling call's inputs packed into forwards on the host, with numpy: the inputs sorted
by length, cut into forwards of a token and a sequence budget, and each forward's token ids,
positions, token types and sequence bounds in one buffer that reaches the device in one
copy (pinned, asynchronous on a GPU). Nothing here waits for the device, so the host packs
forward N+1 while forward N runs."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch


@dataclass
class PoolInput:
    """One input: token ids, and for an encoder's sentence pair the token type of each."""

    ids: list[int]
    token_types: list[int] | None = None


@dataclass
class PackedCall:
    """Every input of one call, flattened in length order (host arrays)."""

    order: np.ndarray  # [N]: the call's input index of each sorted input
    lens: np.ndarray  # [N] int64, sorted
    ids: np.ndarray  # [T] int64: the sorted inputs' tokens back to back
    positions: np.ndarray  # [T] int64: each token's position in its own input
    types: np.ndarray | None  # [T] int64 token types (sentence pairs), or None


@dataclass
class DeviceForward:
    """One forward's inputs on the device."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    token_types: torch.Tensor | None  # [T] int64
    cu_seqlens: torch.Tensor  # [B + 1] int32
    lens: list[int]


def flat_ids(items: list[PoolInput]) -> tuple[np.ndarray, np.ndarray]:
    """(lens [N], every input's ids back to back [T]) as int64 arrays."""
    lens = np.fromiter((len(x.ids) for x in items), dtype=np.int64, count=len(items))
    ids = np.fromiter(chain.from_iterable(x.ids for x in items), dtype=np.int64,
                      count=int(lens.sum()))
    return lens, ids


def pack_call(items: list[PoolInput], lens: np.ndarray, ids: np.ndarray) -> PackedCall:
    """The call's inputs in length order (stable: equal lengths keep their order)."""
    order = np.argsort(lens, kind="stable")
    starts = np.cumsum(lens) - lens
    slens = lens[order]
    total = int(slens.sum())
    sstarts = np.cumsum(slens) - slens
    within = np.arange(total, dtype=np.int64) - np.repeat(sstarts, slens)
    gather = np.repeat(starts[order], slens) + within  # each sorted token's place in `ids`
    types = None
    if any(x.token_types for x in items):
        all_types = np.fromiter(chain.from_iterable(x.token_types or [0] * len(x.ids)
                                                    for x in items),
                                dtype=np.int64, count=len(ids))
        types = all_types[gather]
    return PackedCall(order, slens, ids[gather], within, types)


def forward_bounds(lens: np.ndarray, token_budget: int, max_seqs: int) -> list[tuple[int, int]]:
    """[first, end) input ranges of the sorted `lens`, each within `token_budget` tokens
    (an input longer than the budget goes alone) and `max_seqs` inputs."""
    bounds, first, tokens = [], 0, 0
    for i, n in enumerate(lens.tolist()):
        if i > first and (tokens + n > token_budget or i - first >= max_seqs):
            bounds.append((first, i))
            first, tokens = i, 0
        tokens += n
    if first < len(lens):
        bounds.append((first, len(lens)))
    return bounds


def to_device(call: PackedCall, first: int, end: int, token_first: int,
              device: torch.device) -> DeviceForward:
    """Inputs [first, end) of `call` (their tokens start at `token_first`) as one forward's
    device tensors, uploaded in one copy."""
    lens = call.lens[first:end]
    t = int(lens.sum())
    rows = slice(token_first, token_first + t)
    cu = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    parts = [call.ids[rows], call.positions[rows], cu]
    if call.types is not None:
        parts.append(call.types[rows])
    host = torch.from_numpy(np.concatenate(parts))
    if device.type == "cuda":
        dev = host.pin_memory().to(device, non_blocking=True)
    else:
        dev = host.to(device)
    b = len(lens)
    types = dev[2 * t + b + 1:] if call.types is not None else None
    return DeviceForward(dev[:t], dev[t:2 * t], types, dev[2 * t:2 * t + b + 1].to(torch.int32),
                         lens.tolist())
