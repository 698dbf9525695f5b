"""Reading a request's JSON body: bounded in size, and only text that can be encoded.

A body over the limit is refused (413) from its Content-Length before it is read, or as
soon as the bytes read pass the limit. JSON may escape lone UTF-16 surrogates ("\\ud800"),
which json.loads accepts but no tokenizer can encode: those bodies are 400s here, not 500s
later. So are bodies nested deeper than Python's recursion limit (about a thousand "["),
which json.loads refuses with a RecursionError.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request

from deployments.errors import APIError

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
# Parsing a body this large takes milliseconds: do it in a worker thread, where the GIL's
# switch interval lets the event loop serve other clients in between.
PARSE_IN_THREAD_BYTES = 256 * 1024


def _too_large(limit: int) -> APIError:
    return APIError(f"Request body is larger than the server's limit of {limit} bytes",
                    status=413, code="request_too_large")


async def read_json_body(request: Request, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    body = b"".join(chunks)
    if len(body) > PARSE_IN_THREAD_BYTES:
        return await asyncio.to_thread(parse_json, body)
    return parse_json(body)


def parse_json(body: bytes) -> Any:
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError.bad_request(f"Invalid JSON body: {e}", code="invalid_json") from None
    except RecursionError:
        raise APIError.bad_request("Invalid JSON body: nested too deeply",
                                   code="invalid_json") from None
    if b"\\u" not in body and b"\xed" not in body:
        return value  # neither a \u escape nor a surrogate's UTF-8 lead byte: nothing to check
    try:  # a lone surrogate survives json.loads but not UTF-8 encoding
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError.bad_request("Invalid JSON body: a string holds a lone UTF-16 surrogate "
                                   "(e.g. \\ud800), which is not valid Unicode text",
                                   code="invalid_text") from None
    return value
