"""Programmatic dependent launch (PDL, Hopper and later) for our Triton kernels.

A batch-1 decode step is a few hundred kernels of a few microseconds each, and in a plain
stream every one starts only after the one before has fully drained: its launch and
ramp-up are paid again at every boundary. Launched with PDL, a kernel's grid may be
scheduled while the previous kernel's last blocks still run; it then blocks in `gdc_wait`
until that kernel is complete and its writes are visible.

Every kernel launched with PDL calls `pdl_prologue` before its first global memory access,
so memory order stays exactly that of a plain stream: `gdc_wait` first (the previous grid
is complete), then `gdc_launch_dependents` (the next grid may be scheduled now; it will wait
for this one in turn). Because each kernel waits for its predecessor before it can finish,
a kernel two launches back is complete too, and kernels launched without PDL (cuBLAS, torch)
wait for everything before them as usual. Kernels take a `PDL: tl.constexpr` that is False
unless the launch passes `**pdl_launch(device)`: off on CPUs, under the interpreter (which
has no grid-dependency instructions), before sm_90, where Triton lacks the launch option,
and when RADIXSERVE_PDL=0 (to A/B it).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: PDL stays off, the prologue is never traced
    gdc_wait = gdc_launch_dependents = None

_ON = {"PDL": True, "launch_pdl": True}


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """Wait for the previous kernel in the stream, then let the next one be scheduled."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def _triton_supports_pdl() -> bool:
    if gdc_wait is None:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.lru_cache(maxsize=None)
def _enabled(device_index: int) -> bool:
    if os.environ.get("RADIXSERVE_PDL", "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9 and _triton_supports_pdl()


def pdl_launch(device: torch.device) -> dict:
    """Keyword arguments that launch a kernel with a `PDL` constexpr under PDL on `device`
    (none where PDL is off, so the kernel keeps its plain binary)."""
    if device.type != "cuda":
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _ON if _enabled(index) else {}
