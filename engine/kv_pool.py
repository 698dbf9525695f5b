"""The KV memory pool: one slot per token per layer (page size 1), and its allocator."""
from __future__ import annotations

import torch


class KVPool:
    """Per-layer K and V tensors of shape [num_slots + 1, kv_heads, head_dim].

    Slot 0 is never handed out: padded batch entries (CUDA graphs) write their
    garbage there. Usable slots are 1..num_slots.
    """

    def __init__(self, num_slots: int, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.num_slots = num_slots
        shape = (num_slots + 1, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.allocator = SlotAllocator(num_slots)

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


class SlotAllocator:
    """Free-slot stack over slot ids 1..num_slots. Host-side and O(n) in slots moved."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n slots, or None (nothing taken) when fewer than n are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        out.reverse()
        return out

    def free(self, slots: list[int]) -> None:
        self._free.extend(slots)
