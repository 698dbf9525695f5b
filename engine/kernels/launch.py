"""How this process launches its Triton kernels: the engine's kernel settings as they stand
here, and programmatic dependent launch (PDL) under them. Every kernel imports this module,
which imports no other engine module, so the kernels sit one floor above the ground.

Kernel settings (`EngineConfig.kernels`, `kernel_settings()`). PDL's launch option is chosen at every Triton launch (a dozen kernel files), the GEMV's tiles
and partial-sum handling deep inside engine/kernels/gemv.py: threading a flag through each
call would touch every launch wrapper for an A/B switch. So these are process-wide: every
model runner applies its config here before it loads and captures anything, in each process
that runs a model (the engine's own, an engine child process, every tensor-parallel rank).
The last engine built in a process decides; CUDA graphs captured before keep the kernels
they were captured with. Settings with an owner object (the attention backend, the sampler,
the linears) are passed to that owner instead.

PDL (Hopper and later). A batch-1 decode step is a few hundred kernels of a few microseconds each, and in a plain
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
and when the engine's `kernels.pdl` is off (to A/B it; applied here).
"""
from __future__ import annotations

import functools
import os
from typing import Protocol

import torch
import triton
import triton.language as tl


class KernelSwitches(Protocol):
    """engine/config.py's KernelConfig as this module reads it: the switches it names; the
    others are read by name (`setting_on`). Named here, not imported, so that this module
    stays the kernels' ground floor."""

    pdl: bool
    split_sums: bool


# None until a model runner applies its settings: then every path is on, as in
# `KernelConfig()` (whose switches all default to True: tests/test_kernel_config.py
# test_every_switch_is_a_bool_defaulting_on).
_current: KernelSwitches | None = None


def apply_kernel_config(kernels: KernelSwitches) -> None:
    global _current
    _current = kernels


def kernel_settings() -> KernelSwitches | None:
    """The settings applied last in this process; None before any (every path on)."""
    return _current


def setting_on(name: str) -> bool:
    """One boolean switch of `EngineConfig.kernels` as applied here (on by default)."""
    return _current is None or bool(getattr(_current, name))


def split_sums_on() -> bool:
    """Off (`kernels.split_sums`): every GEMV sums its own K slices and the MoE experts
    their choices."""
    return setting_on("split_sums")


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
def _enabled(device_index: int, wanted: bool = True) -> bool:
    if not wanted or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9 and _triton_supports_pdl()


def pdl_launch(device: torch.device) -> dict:
    """Keyword arguments that launch a kernel with a `PDL` constexpr under PDL on `device`
    (none where PDL is off, so the kernel keeps its plain binary)."""
    if device.type != "cuda":
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _ON if _enabled(index, setting_on("pdl")) else {}
