"""The GPU pool of adapter weights: `max_loras` slots, each holding one adapter's A and B
for every adaptable projection of every layer, zero-padded to the pool's rank.

The model fuses q/k/v and gate/up into one linear each; a fused linear's pool tensors stack
its parts: A [slots, parts * R, in] (part p's rows at p * R) and B [slots, out, R] (part
p's output columns where the linear puts them). A part an adapter does not target stays
zero, so every slot runs the same kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.lora.adapter import LoRAAdapter, TargetShape

# The model's linear that holds each projection, and that linear's parts in output order.
GROUPS = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
          ("self_attn", "o_proj", ("o_proj",)),
          ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
          ("mlp", "down_proj", ("down_proj",)))
RANK_ALIGN = 16  # the kernels' K tile: the pool's rank is a multiple of it


@dataclass
class PoolGroup:
    """One fused linear of one layer: its parts' output sizes, and its slots' A and B."""

    layer: int
    parts: tuple[str, ...]
    part_sizes: tuple[int, ...]
    linear: nn.Module
    a: torch.Tensor  # [slots, len(parts) * R, in]
    b: torch.Tensor  # [slots, out, R]

    @property
    def bounds(self) -> list[int]:
        """Output column where each part after the first starts."""
        out, at = [], 0
        for n in self.part_sizes[:-1]:
            at += n
            out.append(at)
        return out


def _part_sizes(linear: nn.Module, parts: tuple[str, ...]) -> tuple[int, ...]:
    if len(parts) == 3:
        return (linear.q_size, linear.kv_size, linear.kv_size)
    if len(parts) == 2:
        return tuple(linear.local_sizes)
    return (linear.weight.shape[0],)


def adaptable_linears(model: nn.Module) -> list[tuple[int, nn.Module, tuple[str, ...]]]:
    """(layer, linear, parts) of every projection adapters can target (an MoE layer's
    experts are not: only its attention)."""
    out = []
    for i, layer in enumerate(model.model.layers):
        for block, attr, parts in GROUPS:
            linear = getattr(getattr(layer, block), attr, None)
            if linear is not None:
                out.append((i, linear, parts))
    return out


def target_shapes(model: nn.Module) -> dict[tuple[int, str], TargetShape]:
    shapes = {}
    for i, linear, parts in adaptable_linears(model):
        for part, size in zip(parts, _part_sizes(linear, parts)):
            shapes[(i, part)] = TargetShape(linear.weight.shape[1], size)
    return shapes


class LoRAPool:
    def __init__(self, model: nn.Module, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.rank = -(-max_rank // RANK_ALIGN) * RANK_ALIGN
        self.num_slots = num_slots
        self.groups: list[PoolGroup] = []
        for i, linear, parts in adaptable_linears(model):
            sizes = _part_sizes(linear, parts)
            in_features = linear.weight.shape[1]
            a = torch.zeros(num_slots, len(parts) * self.rank, in_features, dtype=dtype, device=device)
            b = torch.zeros(num_slots, sum(sizes), self.rank, dtype=dtype, device=device)
            self.groups.append(PoolGroup(i, parts, sizes, linear, a, b))
        self.ranks = torch.zeros(num_slots, dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        return sum(g.a.numel() * g.a.element_size() + g.b.numel() * g.b.element_size()
                   for g in self.groups)

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy the adapter's weights into `slot` (the rest of the slot zeroed)."""
        r_pool = self.rank
        for g in self.groups:
            g.a[slot].zero_()
            g.b[slot].zero_()
            offset = 0
            for p, (part, size) in enumerate(zip(g.parts, g.part_sizes)):
                pair = adapter.weights.get((g.layer, part))
                if pair is not None:
                    a, b = pair
                    r = a.shape[0]
                    g.a[slot, p * r_pool:p * r_pool + r].copy_(a)
                    g.b[slot, offset:offset + size, :r].copy_(b)
                offset += size
        self.ranks[slot] = adapter.rank
