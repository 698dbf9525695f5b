"""Host-to-device upload of a step's packed integers through reused pinned buffers: many
small pinned allocations and copies cost more than the decode step itself. And host values
on their way to the device without a sync (`to_device`, `take_rows`): under the overlap
scheduler the host must never wait for the GPU while it launches a step."""
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


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.tensor(values, device=device)` without its host sync: a copy from pageable
    memory makes the host wait until the GPU has run everything queued before it, which
    under overlap scheduling is the step still running. From pinned memory, asynchronous;
    PyTorch's pinned allocator keeps the buffer until the copy is done."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows] (rows: host ints) without a host sync (a list index is a pageable copy)."""
    if rows == list(range(t.shape[0])):
        return t
    return t.index_select(0, to_device(rows, torch.long, t.device))


def to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """A device tensor's non-blocking copy into pinned host memory: its values are there
    once the stream has passed the copy (wait on an event recorded after it)."""
    if t is None or not t.is_cuda:
        return t
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
