"""Handing results from an engine thread to the asyncio loops its callers wait on: each
call is scheduled on the waiting loop (`loop.call_soon_threadsafe`), never run on the
engine's thread. Shared by AsyncEngine (engine thread) and ProcessAsyncEngine (the reader
thread of the engine process's messages)."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any


def deliver(items: list[tuple[Callable[[Any], None], Any]]) -> None:
    """Run each stream's `put` on its item (one loop wake-up for a whole step's items)."""
    for put, item in items:
        put(item)


def call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
    """`fn(*args)` on `loop`; nothing when that loop has closed (nobody waits there)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def set_exception(fut: asyncio.Future, error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)
