"""Host-to-device upload of a step's packed integers through reused pinned buffers: many
small pinned allocations and copies cost more than the decode step itself."""
from __future__ import annotations

import torch


class PinnedUploader:
    def __init__(self, device: torch.device, ring: int = 4) -> None:
        self.device = device
        # A ring of pinned staging buffers, each reused only after its copy completed.
        self._staging = [torch.empty(0, dtype=torch.long) for _ in range(ring)]
        self._done: list[torch.cuda.Event | None] = [None] * ring
        self._uploads = 0

    def upload(self, flat: torch.Tensor) -> torch.Tensor:
        """`flat` (a host int64 tensor) on the device, in one non-blocking copy; on a CPU
        device, `flat` itself."""
        if self.device.type != "cuda":
            return flat
        slot = self._uploads % len(self._staging)
        self._uploads += 1
        if self._done[slot] is not None:
            self._done[slot].synchronize()
        if self._staging[slot].numel() < flat.numel():
            self._staging[slot] = torch.empty(2 * flat.numel(), dtype=torch.long, pin_memory=True)
        staging = self._staging[slot][:flat.numel()]
        staging.copy_(flat)
        on_device = staging.to(self.device, non_blocking=True)
        self._done[slot] = torch.cuda.Event()
        self._done[slot].record()
        return on_device
