"""Tensor-parallel context: which rank this process is, and its collectives.

At size 1 the collectives are the identity, and the layers do not even call them, so a
single-GPU model is a plain dense model. Across processes, `engine.executor.distributed.DistributedTP`
backs them with torch.distributed (a process group in `group`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import torch

# A full checkpoint tensor, or a lazy safetensors slice (`safe_open(...).get_slice(name)`),
# which reads only the indexed part from disk: each rank loads just its shard.
Loadable = Union[torch.Tensor, Any]


@dataclass
class TPContext:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed process group (see engine/executor/distributed.py)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad TP rank/size: rank={self.rank}, size={self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over all ranks (in place where possible)."""
        if self.size == 1:
            return x
        raise NotImplementedError("tensor parallelism (size > 1) needs engine.distributed.DistributedTP")

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' x concatenated along `dim`, in rank order."""
        if self.size == 1:
            return x
        raise NotImplementedError("tensor parallelism (size > 1) needs engine.distributed.DistributedTP")

    def min_over_ranks(self, value: int) -> int:
        """The smallest of the ranks' values (e.g. KV slots: every rank must hold as many)."""
        if self.size == 1:
            return value
        raise NotImplementedError("tensor parallelism (size > 1) needs engine.distributed.DistributedTP")


def divide(n: int, d: int, what: str = "size") -> int:
    if n % d != 0:
        raise ValueError(f"{what} {n} is not divisible by tensor parallel size {d}")
    return n // d


def loaded_shape(loaded: Loadable) -> tuple[int, ...]:
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def narrow(loaded: Loadable, dim: int, start: int, length: int) -> torch.Tensor:
    """loaded[..., start:start+length, ...] along `dim`, as a tensor; reads only that part of a slice."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    index = [slice(None)] * len(loaded.get_shape())
    index[dim] = slice(start, start + length)
    return loaded[tuple(index)]


def materialize(loaded: Loadable) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def copy_into(dst: torch.Tensor, src: torch.Tensor, name: str = "") -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch loading {name or 'weight'}: expected {tuple(dst.shape)}, "
                         f"got {tuple(src.shape)}")
    with torch.no_grad():
        dst.copy_(src)
