"""PrefixRows: a prefix's KV on the CPU, as one replica exports it and another imports it
(engine/executor/kv_transfer.py reads and writes them, engine/runtime/prefix_exchange.py
carries them)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefixRows:
    """One prefix's KV as CPU tensors [layers, tokens, kv heads, head dim]: what replicas
    hand each other (through Ray's object store)."""

    k: torch.Tensor
    v: torch.Tensor
