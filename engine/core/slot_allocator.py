"""The KV slot allocator: which of the pool's slots are free (host side; the device KV pool is
engine/attention/kv_pool.py)."""
from __future__ import annotations

from array import array
from collections.abc import Sequence


class SlotAllocator:
    """Free-slot stack over slot ids 1..num_slots. Host-side and O(n) in slots moved. An
    int64 array, not a list: the garbage collector never walks it (a fresh H200 pool is
    ~1M slots)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = array("q", range(num_slots, 0, -1))

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
        return out.tolist()

    def free_slots(self) -> list[int]:
        """Every free slot (for leak checks)."""
        return self._free.tolist()

    def free(self, slots: Sequence[int]) -> None:
        self._free.extend(slots)
