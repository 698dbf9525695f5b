"""Where a LoRA adapter's request is cheapest to serve: the replicas' adapter tiers.

Every engine replica reports, in its routing stats, the adapters in its GPU pool (`loras`)
and those registered with a host copy but not in the pool (`loras_cpu`). A request for an
adapter prefers, in order, a replica that has it in its GPU pool (nothing to copy), one
that has it in host memory (a host-to-GPU copy), then any (a disk read: the replica loads
it on first use from `lora_dynamic_path`). The prefix's rendezvous order stands within a
tier, so every ingress ranks alike; a base-model request ranks every replica in the top
tier and this changes nothing.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import IntEnum
from typing import Any, Protocol

STAT_LORAS = "loras"  # the adapters in the replica's GPU pool
STAT_LORAS_CPU = "loras_cpu"  # registered with a host copy, not in the GPU pool


class AdapterTier(IntEnum):
    ELSEWHERE = 0  # the replica would read the adapter from disk first (or cannot serve it)
    IN_CPU = 1
    IN_GPU = 2  # or no adapter asked


class _Tiered(Protocol):
    adapter_tier: int


def lora_of(request: Any) -> str | None:
    """The adapter a handle call's request asks for: its `params.lora` (the engine's
    SamplingParams) or `sampling["lora"]` (a dict of sampling settings); duck-typed, the
    router imports no deployment or engine types."""
    if isinstance(request, Mapping):
        params, sampling = request.get("params"), request.get("sampling")
    else:
        params, sampling = getattr(request, "params", None), getattr(request, "sampling", None)
    lora = getattr(params, "lora", None)
    if lora is None and isinstance(sampling, Mapping):
        lora = sampling.get("lora")
    return lora if isinstance(lora, str) else None


def adapter_tier(routing_stats: Mapping[str, Any] | None, lora: str | None) -> AdapterTier:
    """The tier of a replica (by its last routing stats) for a request of adapter `lora`."""
    if lora is None:
        return AdapterTier.IN_GPU
    stats = routing_stats or {}
    if lora in (stats.get(STAT_LORAS) or ()):
        return AdapterTier.IN_GPU
    if lora in (stats.get(STAT_LORAS_CPU) or ()):
        return AdapterTier.IN_CPU
    return AdapterTier.ELSEWHERE


def by_adapter_tier(ranked: Sequence[_Tiered]) -> list:
    """`ranked` with higher tiers first; the order within a tier kept (a stable sort)."""
    return sorted(ranked, key=lambda c: -c.adapter_tier)
