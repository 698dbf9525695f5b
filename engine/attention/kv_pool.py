"""The device KV pool: one slot per token per layer (page size 1); which slots are free is
engine/core/slot_allocator.py's."""
from __future__ import annotations

import torch

from engine.core.slot_allocator import SlotAllocator
from engine.quantization.fp8 import FP8, to_fp8


class KVPool:
    """Per-layer K and V tensors of shape [num_slots + 1, kv_heads, head_dim] (V's last dim
    `v_head_dim` when given: 0 for MLA's latent pool, whose K row is all a token keeps).

    Slot 0 is never handed out: padded batch entries (CUDA graphs) write their
    garbage there. Usable slots are 1..num_slots.

    A float8 pool (kv_cache_dtype="fp8_e4m3") stores value / scale, saturated to the float8
    range; `encode` and `decode` convert. One scale for the whole pool: e4m3 keeps the same
    relative precision from 2^-6 to 448, so the scale only has to keep K/V inside that range,
    and 1.0 does for the models we run (no calibrated scales are read from checkpoints).
    """

    def __init__(self, num_slots: int, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, scale: float = 1.0,
                 v_head_dim: int | None = None) -> None:
        self.num_slots = num_slots
        self.dtype = dtype
        self.fp8 = dtype == FP8
        self.scale = scale
        shape = (num_slots + 1, kv_heads, head_dim)
        v_shape = shape if v_head_dim is None else (num_slots + 1, kv_heads, v_head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(v_shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.allocator = SlotAllocator(num_slots)

    @classmethod
    def over(cls, k: list[torch.Tensor], v: list[torch.Tensor]) -> "KVPool":
        """A pool over existing per-layer tensors (e.g. an fp32 copy of another pool, as the
        attention kernels' reference), without an allocator of its own."""
        pool = cls.__new__(cls)
        pool.num_slots = k[0].shape[0] - 1
        pool.dtype = k[0].dtype
        pool.fp8 = pool.dtype == FP8
        pool.scale = 1.0
        pool.k, pool.v = k, v
        return pool

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """New K or V -> what the pool stores."""
        # divided in float32: one rounding (to float8), as the Triton store kernel does
        return to_fp8(x.float() / self.scale) if self.fp8 else x.to(self.dtype)

    def decode(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Gathered pool rows -> values in the model's `dtype`."""
        return stored.to(dtype) * self.scale if self.fp8 else stored

    @property
    def token_bytes(self) -> int:
        """Bytes one token's slot holds over all layers (K and V)."""
        return sum(t[0].numel() * t.element_size() for t in self.k + self.v)

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                        v_head_dim: int | None = None) -> int:
        v_dim = head_dim if v_head_dim is None else v_head_dim
        per_layer = kv_heads * (head_dim + v_dim)
        return num_layers * per_layer * torch.tensor([], dtype=dtype).element_size()
