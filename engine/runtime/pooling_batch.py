"""A pooling call's inputs packed into forwards on the host, with numpy: the inputs sorted
by length and cut into forwards of a token and a sequence budget (`plan_call`), then each
forward's token ids, positions, token types and sequence bounds gathered into one buffer
that reaches the device in one copy (`pack_forward`, `upload`: pinned and asynchronous on
a GPU). Nothing here waits for the device, and a forward's tokens are gathered only when
it is next, so the host packs forward N+1 while the device runs forward N."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Protocol

import numpy as np
import torch


class PoolItem(Protocol):
    """engine/runtime/pooling_input.py's PoolInput as packing reads it (named here, so
    that this module needs no neighbour in its room)."""

    ids: list[int]
    token_types: list[int] | None


@dataclass
class CallPlan:
    """A call's inputs in length order (stable: equal lengths keep their order), cut into
    forwards."""

    order: np.ndarray  # [N]: the call's input index of each sorted input
    lens: np.ndarray  # [N] int64, sorted
    bounds: list[tuple[int, int]]  # each forward's [first, end) of the sorted inputs
    has_types: bool  # some input carries token types (sentence pairs)


@dataclass
class DeviceForward:
    """One forward's inputs on the device."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64: each token's position in its own sequence
    token_types: torch.Tensor | None  # [T] int64
    cu_seqlens: torch.Tensor  # [B + 1] int32: sequence i is rows [cu[i], cu[i+1])
    lens: list[int]


def input_lens(items: list[PoolItem]) -> np.ndarray:
    return np.fromiter((len(x.ids) for x in items), dtype=np.int64, count=len(items))


def flat_ids(items: list[PoolItem]) -> np.ndarray:
    """Every input's ids back to back, int64 (OverflowError for an id past int64)."""
    return np.fromiter(chain.from_iterable(x.ids for x in items), dtype=np.int64,
                       count=sum(len(x.ids) for x in items))


def plan_call(items: list[PoolItem], lens: np.ndarray, token_budget: int,
              max_seqs: int) -> CallPlan:
    order = np.argsort(lens, kind="stable")
    slens = lens[order]
    has_types = any(x.token_types for x in items)
    return CallPlan(order, slens, forward_bounds(slens, token_budget, max_seqs), has_types)


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


def pack_forward(items: list[PoolItem], plan: CallPlan, first: int, end: int) -> np.ndarray:
    """The host buffer of sorted inputs [first, end): ids [T] | positions [T] | cu [B + 1]
    (| token types [T]), int64."""
    lens = plan.lens[first:end]
    picked = [items[i] for i in plan.order[first:end].tolist()]
    t = int(lens.sum())
    cu = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    parts = [flat_ids(picked), np.arange(t, dtype=np.int64) - np.repeat(cu[:-1], lens), cu]
    if plan.has_types:
        parts.append(np.fromiter(chain.from_iterable(x.token_types or [0] * len(x.ids)
                                                     for x in picked), dtype=np.int64, count=t))
    return np.concatenate(parts)


def upload(host: np.ndarray, lens: np.ndarray, has_types: bool,
           device: torch.device) -> DeviceForward:
    """`pack_forward`'s buffer on the device, in one copy."""
    t, b = int(lens.sum()), len(lens)
    buf = torch.from_numpy(host)
    if device.type == "cuda":
        buf = buf.pin_memory()  # so the copy is asynchronous: the host goes on packing
    dev = buf.to(device, non_blocking=True)
    types = dev[2 * t + b + 1:] if has_types else None
    return DeviceForward(dev[:t], dev[t:2 * t], types, dev[2 * t:2 * t + b + 1].to(torch.int32),
                         lens.tolist())
