"""deployments/keepalive.py without Ray: what a non-streamed answer behind HAProxy becomes."""
from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from deployments import keepalive
from deployments.errors import APIError


class Answer(BaseModel):
    text: str


@pytest.fixture(autouse=True)
def fast_keepalives(monkeypatch):
    monkeypatch.setattr(keepalive, "KEEPALIVE_AFTER_S", 0.05)
    monkeypatch.setattr(keepalive, "KEEPALIVE_PERIOD_S", 0.05)


async def _after(seconds: float, result=None, error: Exception | None = None):
    await asyncio.sleep(seconds)
    if error is not None:
        raise error
    return result


async def _body(response: StreamingResponse) -> bytes:
    return b"".join([chunk async for chunk in response.body_iterator])


def test_without_keepalives_or_when_quick_the_answer_is_returned_as_it_is():
    async def main():
        answer = Answer(text="é")
        assert await keepalive.respond(_after(0.2, answer), keepalives=False) is answer
        assert await keepalive.respond(_after(0.0, answer), keepalives=True) is answer
        with pytest.raises(APIError):  # a quick error keeps its own status
            await keepalive.respond(_after(0.0, error=APIError.unavailable("full")), keepalives=True)

    asyncio.run(main())


def test_a_slow_answer_is_spaces_then_the_json_fastapi_would_send():
    async def main():
        response = await keepalive.respond(_after(0.3, Answer(text="é")), keepalives=True)
        assert isinstance(response, StreamingResponse) and response.status_code == 200
        assert response.media_type == "application/json"
        body = await _body(response)
        spaces = len(body) - len(body.lstrip(b" "))
        assert 2 <= spaces <= 8, body
        assert body.lstrip(b" ") == JSONResponse({"text": "é"}).body
        response = await keepalive.respond(_after(0.2, JSONResponse([1, 2])), keepalives=True)
        assert json.loads(await _body(response)) == [1, 2]

    asyncio.run(main())


def test_an_error_after_the_status_went_out_is_the_openai_error_object():
    async def main():
        for error, kind in ((APIError.unavailable("engine replica failed"), "engine replica failed"),
                            (RuntimeError("boom"), None)):
            response = await keepalive.respond(_after(0.2, error=error), keepalives=True)
            body = json.loads(await _body(response))
            assert set(body) == {"error"} and body["error"]["message"]
            if kind:
                assert body["error"]["message"] == kind

    asyncio.run(main())


def test_closing_the_body_cancels_the_work():
    """What Starlette does when the client is gone: the request's engine calls are cancelled."""
    async def main():
        work = asyncio.ensure_future(_after(30, Answer(text="never")))
        body = keepalive.body_with_keepalives(work, 0.05)
        assert await anext(body) == b" "
        await body.aclose()
        await asyncio.sleep(0)
        assert work.cancelled()

    asyncio.run(main())
