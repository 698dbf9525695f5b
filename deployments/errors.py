"""OpenAI-style error responses for the HTTP layer.

Every error leaves the server as `{"error": {"message", "type", "param", "code"}}`
with a matching status. Request validation problems are 400 (FastAPI's default
is 422, which OpenAI clients don't expect) and name the offending field.
"""
from __future__ import annotations

import json
import logging
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}
# Said instead of the real exception text: internals shouldn't leak to clients.
INTERNAL_ERROR_MESSAGE = "The server had an error while processing your request."
# The one message for "no room for this request now", wherever it is refused (the engine's
# bound, Serve's queue bound): clients and dashboards see one condition.
OVERLOADED_MESSAGE = "The server is at capacity; retry after the Retry-After interval."


def default_error_type(status: int) -> str:
    if status in _TYPE_BY_STATUS:
        return _TYPE_BY_STATUS[status]
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    """The OpenAI error envelope."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class APIError(Exception):
    """An error meant for the client, raised anywhere while serving a request."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers
        self.message = message
        self.status = status
        self.type = type or default_error_type(status)
        self.param = param
        self.code = code

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.type!r}, {self.message!r}, param={self.param!r})"

    @classmethod
    def bad_request(cls, message: str, param: str | None = None, code: str | None = None) -> APIError:
        return cls(message, 400, param=param, code=code)

    @classmethod
    def not_found(cls, message: str, param: str | None = None) -> APIError:
        return cls(message, 404, param=param, code="not_found")

    @classmethod
    def unavailable(cls, message: str = OVERLOADED_MESSAGE,
                    retry_after_s: int = 1) -> APIError:
        return cls(message, 503, headers={"Retry-After": str(retry_after_s)})

    @classmethod
    def internal(cls, message: str = INTERNAL_ERROR_MESSAGE) -> APIError:
        return cls(message, 500)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse_event(self) -> str:
        """The error as an SSE event, for failures after a stream has started (status is already 200)."""
        return f"data: {json.dumps(self.body())}\n\n"


# --------------------------------------------------------------------------
# Validation errors -> readable 400s
# --------------------------------------------------------------------------

_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "function-plain", "function-after"}


def _is_type_tag(segment: object) -> bool:
    # Pydantic puts union branch names ("str", "list[int]", ...) into error locations.
    return isinstance(segment, str) and (segment in _TYPE_TAGS or "[" in segment)


def _dotted(loc: tuple[Any, ...]) -> str | None:
    """('body', 'messages', 0, 'content') -> 'messages.0.content'; FastAPI's 'body' prefix is dropped."""
    parts = list(loc)
    if parts and parts[0] == "body":
        parts = parts[1:]
    parts = [str(p) for p in parts if not _is_type_tag(p)]
    return ".".join(parts) or None


def _short_msg(err: dict[str, Any]) -> str:
    msg = str(err.get("msg", "invalid value"))
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            return msg[len(prefix):]
    return msg


def _json_error(err: dict[str, Any]) -> APIError:
    detail = (err.get("ctx") or {}).get("error") or _short_msg(err)
    return APIError.bad_request(f"Invalid JSON body: {detail}", code="invalid_json")


def _describe(param: str | None, errs: list[dict[str, Any]]) -> str:
    """One field's message; several errors for one field come from union branches."""
    msgs = list(dict.fromkeys(_short_msg(e) for e in errs))
    if len(msgs) > 1:
        alternatives = [m.removeprefix("Input should be ") for m in msgs]
        text = "Input should be " + " or ".join(alternatives)
    else:
        text = msgs[0]
    if param is None:
        return text
    if errs[0].get("type") == "missing":
        return f"Missing required field '{param}'"
    return f"Invalid value for '{param}': {text}"


def from_validation_error(exc: pydantic.ValidationError | RequestValidationError) -> APIError:
    """Turn a pydantic/FastAPI validation error into a 400 naming the first bad field."""
    errors: list[dict[str, Any]] = list(exc.errors())
    if not errors:
        return APIError.bad_request("Invalid request")
    for err in errors:
        if err.get("type") == "json_invalid":
            return _json_error(err)
    by_param: dict[str | None, list[dict[str, Any]]] = {}
    for err in errors:
        by_param.setdefault(_dotted(tuple(err.get("loc", ()))), []).append(err)
    first_param, first_errs = next(iter(by_param.items()))
    if first_param is None and first_errs[0].get("type") == "missing":
        return APIError.bad_request("Request body is required and must be a JSON object")
    messages = [_describe(p, errs) for p, errs in by_param.items()]
    message = "; ".join(messages[:3]) + (f" (and {len(messages) - 3} more)" if len(messages) > 3 else "")
    return APIError.bad_request(message, param=first_param)


def as_api_error(exc: BaseException) -> APIError:
    """Best APIError for any exception; unknown ones become a generic 500 (and are logged)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (pydantic.ValidationError, RequestValidationError)):
        return from_validation_error(exc)
    if isinstance(exc, json.JSONDecodeError):
        return APIError.bad_request(f"Invalid JSON body: {exc.msg}", code="invalid_json")
    logger.error("unhandled error while serving a request", exc_info=exc)
    return APIError.internal()


# --------------------------------------------------------------------------
# FastAPI wiring
# --------------------------------------------------------------------------


async def _handle_any(request: Request, exc: Exception) -> JSONResponse:
    return as_api_error(exc).to_response()


async def _handle_http(request: Request, exc: Exception) -> JSONResponse:
    # Routing errors (404 unknown path, 405 wrong method) in the same envelope.
    assert isinstance(exc, StarletteHTTPException)
    err = APIError(str(exc.detail), exc.status_code)
    response = err.to_response()
    for key, value in (exc.headers or {}).items():
        response.headers[key] = value
    return response


def install_error_handlers(app: FastAPI) -> None:
    """Make every error from `app` an OpenAI-style JSON error with a sensible status."""
    for exc_type in (APIError, RequestValidationError, pydantic.ValidationError, json.JSONDecodeError):
        app.add_exception_handler(exc_type, _handle_any)
    app.add_exception_handler(StarletteHTTPException, _handle_http)
    # Registered on Exception, Starlette runs this in its outermost middleware: the client gets
    # our 500 body, and the exception still propagates to the server's own logging.
    app.add_exception_handler(Exception, _handle_any)
