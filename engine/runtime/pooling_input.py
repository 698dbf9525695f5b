"""One input of the pooling tasks (embed / score) as the pooling engine takes it: its own module
so that the request side (engine/runtime/pooling_requests.py) builds inputs without importing
the engine and its models."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolInput:
    """One input: token ids, and for an encoder's sentence pair the token type of each."""

    ids: list[int]
    token_types: list[int] | None = None
