"""Non-streamed responses that notice a client that left, behind HAProxy.

Serve's own proxy cancels a request whose client disconnects, and the engine aborts it. Under
`RAY_SERVE_ENABLE_HA_PROXY=1` the client talks to HAProxy, which keeps its connection to the
ingress replica open when the client leaves before the response (`abortonclose` only drops
requests still queued): nothing reaches the ingress, and a non-streamed generation would run
to `max_tokens` for nobody. A stream learns of it at its next write, when HAProxy fails to
forward it and closes the replica's connection.

So behind HAProxy a non-streamed request still generating after `KEEPALIVE_AFTER_S` commits
its 200 and writes one space every `KEEPALIVE_PERIOD_S` until the JSON body follows (JSON
allows whitespace before a value; the openai client parses it as usual). The write after the
client left is what HAProxy fails on; Starlette then closes the body's generator, which
cancels the request like a stream's. What ends sooner gets an ordinary response with its own
status; an error after the 200 (an engine replica lost mid-generation) comes back as the
OpenAI error object in that 200's body.
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deployments.errors import as_api_error

KEEPALIVE_AFTER_S = 0.5
KEEPALIVE_PERIOD_S = 0.5


def behind_haproxy() -> bool:
    """Does HAProxy front this Serve instance? (Serve reads the same variable at start-up.)"""
    return os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1"


async def respond(work: Awaitable[Any], keepalives: bool) -> Any:
    """What `work` returns (a Response, or a model FastAPI renders), or with `keepalives` and
    `work` still running after KEEPALIVE_AFTER_S, a 200 whose body is spaces, then that."""
    if not keepalives:
        return await work
    task = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({task}, timeout=KEEPALIVE_AFTER_S)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if done:
        return task.result()
    return StreamingResponse(body_with_keepalives(task, KEEPALIVE_PERIOD_S),
                             media_type="application/json")


async def body_with_keepalives(task: asyncio.Future, period_s: float) -> AsyncIterator[bytes]:
    """A space every `period_s` until `task` is done, then its JSON. Closing the generator
    (the client is gone) cancels `task`."""
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=period_s)
            if not done:
                yield b" "
        yield _json_bytes(task)
    finally:
        task.cancel()


def _json_bytes(task: asyncio.Future) -> bytes:
    try:
        result = task.result()
    except Exception as e:  # noqa: BLE001 - the status is sent already: the error goes in the body
        return JSONResponse(as_api_error(e).body()).body
    if isinstance(result, Response):
        return result.body
    return JSONResponse(jsonable_encoder(result)).body  # as FastAPI renders a returned model
