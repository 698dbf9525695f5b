"""The engine's kernel settings (`EngineConfig.kernels`) as the kernels of this process see them.

PDL's launch option is chosen at every Triton launch (a dozen kernel files), the GEMV's tiles
and partial-sum handling deep inside engine/kernels/gemv.py: threading a flag through each
call would touch every launch wrapper for an A/B switch. So these are process-wide: every
model runner applies its config here before it loads and captures anything, in each process
that runs a model (the engine's own, an engine child process, every tensor-parallel rank).
The last engine built in a process decides; CUDA graphs captured before keep the kernels
they were captured with. Settings with an owner object (the attention backend, the sampler,
the linears) are passed to that owner instead.
"""
from __future__ import annotations

from engine.config import KernelConfig

_current = KernelConfig()


def apply_kernel_config(kernels: KernelConfig) -> None:
    global _current
    _current = kernels


def kernel_settings() -> KernelConfig:
    return _current
