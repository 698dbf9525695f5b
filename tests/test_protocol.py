"""Tests of the OpenAI protocol models, the error layer and scripts/bench_serving.py.

The benchmark's end-to-end check runs against the fake streaming server built
into bench_serving (`FakeOpenAIServer`), so no real engine is needed.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

import pydantic
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from deployments.errors import APIError, error_body, from_validation_error, install_error_handlers
from deployments.protocol import ChatCompletionRequest, CompletionRequest
from deployments.protocol_responses import (
    SSE_DONE, ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionResponse,
    ChatCompletionStreamChoice, ChatCompletionStreamResponse, ChatMessage, ChatTokenLogprob,
    CompletionChoice, CompletionLogprobs, CompletionResponse, CompletionStreamChoice,
    CompletionStreamResponse, DeltaMessage, ModelCard, ModelList, UsageInfo, sse_event,
)
from deployments.request_sampling import completion_sampling_kwargs, chat_sampling_kwargs

ROOT = Path(__file__).resolve().parents[1]
USER = [{"role": "user", "content": "hi"}]


def _load_bench() -> Any:
    # scripts/ is not a package; load the file as a module (registered so dataclasses work).
    spec = importlib.util.spec_from_file_location("bench_serving", ROOT / "scripts" / "bench_serving.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serving"] = module
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hello", **fields})


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def validation_error(model: type[pydantic.BaseModel], data: dict[str, Any]) -> APIError:
    with pytest.raises(pydantic.ValidationError) as info:
        model.model_validate(data)
    return from_validation_error(info.value)


# --------------------------------------------------------------------------
# Completion requests
# --------------------------------------------------------------------------


def test_completion_defaults() -> None:
    req = completion()
    assert (req.max_tokens, req.n, req.stream, req.echo, req.logprobs) == (16, 1, False, False, None)
    assert not req.include_usage
    assert req.prompts() == ["hello"]


@pytest.mark.parametrize("prompt, expected", [
    ("abc", ["abc"]),
    ([1, 2, 3], [[1, 2, 3]]),
    (["a", "b"], ["a", "b"]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_completion_prompt_forms(prompt: Any, expected: list[Any]) -> None:
    assert completion(prompt=prompt).prompts() == expected


@pytest.mark.parametrize("prompt", [5, [], [[]], [1, "a"], [-1], [True], [[1], "a"], {"a": 1}, None])
def test_completion_bad_prompts(prompt: Any) -> None:
    err = validation_error(CompletionRequest, {"prompt": prompt})
    assert err.status == 400 and err.param == "prompt"
    assert "prompt must be" in err.message


def test_unknown_fields_ignored_and_stream_options() -> None:
    req = completion(user="u1", best_of=1, suffix=None, stream=True, stream_options={"include_usage": True},
                     some_client_extra=3)
    assert req.user == "u1" and req.include_usage
    assert not hasattr(req, "some_client_extra")


@pytest.mark.parametrize("fields", [{"best_of": 2}, {"suffix": "x"}])
def test_fields_not_honoured_are_refused_not_dropped(fields) -> None:
    err = validation_error(CompletionRequest, {"prompt": "x", **fields})
    assert err.status == 400 and next(iter(fields)) in err.message
    completion(best_of=3, n=3, suffix="", echo=True)  # their "off" values pass


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": "abc"}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),  # strict: no string -> int coercion
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": "0.5"}, "temperature"),
    ({"stream": "true"}, "stream"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"n": True}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"stop": 5}, "stop"),
    ({"seed": 1.5}, "seed"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids.0"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"echo": "yes"}, "echo"),
    ({"prompt_logprobs_start": -1}, "prompt_logprobs_start"),
])
def test_completion_wrong_values(fields: dict[str, Any], param: str) -> None:
    err = validation_error(CompletionRequest, {"prompt": "x", **fields})
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", param)
    assert param in err.message


def test_echo_with_logprobs_scores_the_prompt() -> None:
    req = CompletionRequest.model_validate({"prompt": "x", "echo": True, "logprobs": 0})
    assert completion_sampling_kwargs(req)["prompt_logprobs_start"] == 0
    plain = CompletionRequest.model_validate({"prompt": "x", "echo": True})
    assert "prompt_logprobs_start" not in completion_sampling_kwargs(plain)


def test_float_fields_accept_ints() -> None:
    assert completion(temperature=1, top_p=1).temperature == 1.0


def test_missing_field_message() -> None:
    err = validation_error(CompletionRequest, {})
    assert err.param == "prompt" and err.message == "Missing required field 'prompt'"


# --------------------------------------------------------------------------
# Chat requests
# --------------------------------------------------------------------------


def test_chat_messages_and_content_parts() -> None:
    req = chat(messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "42", "tool_call_id": "t1"},
    ])
    assert [m.text() for m in req.messages] == ["be brief", "ab", "", "42"]
    assert req.messages[1].as_template_dict() == {"role": "user", "content": "ab"}
    assert req.max_tokens is None and req.requested_max_tokens is None and req.logprobs is False


@pytest.mark.parametrize("data, param, snippet", [
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages.0.role", "'user'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content", "only 'text' parts"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "valid string"),
    ({"messages": USER, "response_format": {"type": "json_schema"}}, "response_format", "required"),
    ({"messages": USER, "response_format": {"type": "xml"}}, "response_format.type", "json_object"),
    ({"messages": USER, "top_logprobs": 21, "logprobs": True}, "top_logprobs", "20"),
    ({"messages": USER, "max_completion_tokens": -3}, "max_completion_tokens", "greater than"),
])
def test_chat_wrong_values(data: dict[str, Any], param: str, snippet: str) -> None:
    err = validation_error(ChatCompletionRequest, data)
    assert err.status == 400 and err.param == param
    assert snippet in err.message


@pytest.mark.parametrize("data, snippet", [
    ({"top_logprobs": 2}, "requires logprobs=true"),
    ({"response_format": {"type": "json_object"}, "regex": "a+"}, "cannot be combined"),
])
def test_chat_inconsistent_fields(data: dict[str, Any], snippet: str) -> None:
    err = validation_error(ChatCompletionRequest, {"messages": USER, **data})
    assert snippet in err.message and err.param is None


# --------------------------------------------------------------------------
# Mapping to SamplingParams
# --------------------------------------------------------------------------


def test_completion_mapping() -> None:
    kwargs = completion_sampling_kwargs(completion(
        max_tokens=7, temperature=0, stop="\n", logprobs=3, top_k=5, min_p=0.1, ignore_eos=True,
        stop_token_ids=[2], regex="[ab]+", skip_special_tokens=False, seed=3,
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
    ))
    assert kwargs == {
        "max_tokens": 7, "temperature": 0.0, "stop": ["\n"], "logprobs": True, "top_logprobs": 3,
        "top_k": 5, "min_p": 0.1, "ignore_eos": True, "stop_token_ids": [2], "regex": "[ab]+",
        "skip_special_tokens": False, "seed": 3, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "repetition_penalty": 1.1,
    }


def test_mapping_leaves_unset_fields_to_engine_defaults() -> None:
    assert completion_sampling_kwargs(completion()) == {"max_tokens": 16}
    assert chat_sampling_kwargs(chat()) == {}
    assert chat_sampling_kwargs(chat(), default_max_tokens=100) == {"max_tokens": 100}
    assert completion_sampling_kwargs(completion(logprobs=0)) == {"max_tokens": 16, "logprobs": True, "top_logprobs": 0}


def test_chat_mapping() -> None:
    assert chat_sampling_kwargs(chat(max_tokens=5, max_completion_tokens=9))["max_tokens"] == 9
    assert chat_sampling_kwargs(chat(max_tokens=5), default_max_tokens=100)["max_tokens"] == 5
    kwargs = chat_sampling_kwargs(chat(logprobs=True, top_logprobs=4, stop=["a", "b"]))
    assert kwargs == {"logprobs": True, "top_logprobs": 4, "stop": ["a", "b"]}
    assert chat_sampling_kwargs(chat(logprobs=True))["top_logprobs"] == 0
    assert chat_sampling_kwargs(chat(response_format={"type": "json_object"})) == {"json_object": True}
    assert chat_sampling_kwargs(chat(response_format={"type": "text"})) == {}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert chat_sampling_kwargs(chat(response_format=fmt)) == {"json_schema": schema}
    assert chat_sampling_kwargs(chat(json_schema='{"type": "string"}')) == {"json_schema": '{"type": "string"}'}
    assert chat_sampling_kwargs(chat(ebnf="root ::= 'a'")) == {"ebnf": "root ::= 'a'"}


def test_kwargs_build_sampling_params() -> None:
    sp_module = pytest.importorskip("engine.core.sampling_params")
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    sp_module.SamplingParams(**completion_sampling_kwargs(completion(logprobs=2, stop="x", top_k=0)))
    for req in (chat(response_format=fmt, logprobs=True),
                chat(max_completion_tokens=3, seed=1, temperature=0.7)):
        sp_module.SamplingParams(**chat_sampling_kwargs(req))
    with pytest.raises(ValueError, match="temperature"):
        sp_module.SamplingParams(**completion_sampling_kwargs(completion(temperature=-1)))


# --------------------------------------------------------------------------
# Responses (checked against the openai client's own types where available)
# --------------------------------------------------------------------------


def _usage() -> UsageInfo:
    return UsageInfo.build(prompt_tokens=5, completion_tokens=2, cached_tokens=3)


def test_usage_and_ids() -> None:
    usage = _usage().model_dump()
    assert usage == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                     "prompt_tokens_details": {"cached_tokens": 3}}
    resp = CompletionResponse(model="m", choices=[], usage=_usage())
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion" and resp.created > 1e9
    chat_resp = ChatCompletionResponse(model="m", choices=[], usage=_usage())
    assert chat_resp.id.startswith("chatcmpl-") and chat_resp.object == "chat.completion"
    assert ChatCompletionStreamResponse(model="m").object == "chat.completion.chunk"
    assert ModelList(data=[ModelCard(id="m")]).model_dump()["data"][0]["object"] == "model"


def test_completion_response_matches_openai_types() -> None:
    openai_types = pytest.importorskip("openai.types")
    logprobs = CompletionLogprobs(tokens=["a", "b"], token_logprobs=[-0.1, -0.2],
                                  top_logprobs=[{"a": -0.1}, {"b": -0.2}], text_offset=[0, 1])
    resp = CompletionResponse(model="m", usage=_usage(), choices=[
        CompletionChoice(index=0, text="ab", logprobs=logprobs, finish_reason="length")])
    parsed = openai_types.Completion.model_validate(json.loads(resp.model_dump_json()))
    assert parsed.choices[0].logprobs.token_logprobs == [-0.1, -0.2]
    assert parsed.usage.prompt_tokens_details.cached_tokens == 3
    chunk = CompletionStreamResponse(model="m", choices=[CompletionStreamChoice(index=0, text="a")])
    # The openai client parses stream chunks without validation (finish_reason is null mid-stream).
    assert json.loads(chunk.model_dump_json())["choices"] == [
        {"index": 0, "text": "a", "logprobs": None, "finish_reason": None}]


def test_chat_response_matches_openai_types() -> None:
    openai_types = pytest.importorskip("openai.types.chat")
    token = ChatTokenLogprob.build("é", -0.5, top=[("é", -0.5), ("e", -1.0)])
    assert token.bytes == [0xC3, 0xA9] and token.top_logprobs[1].bytes == [ord("e")]
    resp = ChatCompletionResponse(model="m", usage=_usage(), choices=[ChatCompletionChoice(
        index=0, message=ChatMessage(content="é"), logprobs=ChatChoiceLogprobs(content=[token]),
        finish_reason="stop")])
    parsed = openai_types.ChatCompletion.model_validate(json.loads(resp.model_dump_json()))
    assert parsed.choices[0].message.content == "é"
    assert parsed.choices[0].logprobs.content[0].top_logprobs[1].token == "e"


def test_stream_chunks_serialize_like_openai() -> None:
    openai_types = pytest.importorskip("openai.types.chat")
    first = ChatCompletionStreamResponse(model="m", choices=[
        ChatCompletionStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))])
    last = ChatCompletionStreamResponse(model="m", choices=[
        ChatCompletionStreamChoice(index=0, finish_reason="length")])
    assert json.loads(first.model_dump_json())["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    body = json.loads(last.model_dump_json())
    assert body["choices"][0]["delta"] == {} and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] is None  # OpenAI sends usage: null until the final usage chunk
    openai_types.ChatCompletionChunk.model_validate(body)
    event = sse_event(last)
    assert event.startswith("data: {") and event.endswith("\n\n") and json.loads(event[6:]) == body
    assert sse_event({"a": 1}) == 'data: {"a":1}\n\n' and SSE_DONE == "data: [DONE]\n\n"


# --------------------------------------------------------------------------
# Errors through a small FastAPI app
# --------------------------------------------------------------------------


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> dict[str, Any]:
        return completion_sampling_kwargs(req)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> dict[str, Any]:
        # Manual parsing path: bad JSON / ValidationError raised straight from the handler.
        req = ChatCompletionRequest.model_validate(json.loads(await request.body()))
        return chat_sampling_kwargs(req)

    @app.get("/missing-model")
    async def missing() -> None:
        raise APIError.not_found("The model 'x' does not exist", param="model")

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret internal detail")

    return app


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(_app(), raise_server_exceptions=False)


def _assert_error(resp: Any, status: int, type_: str, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == type_ and err["param"] == param
    return err


def test_http_ok(client: TestClient) -> None:
    assert client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3}).json() == {"max_tokens": 3}
    assert client.post("/v1/chat/completions", json={"messages": USER, "n": 2}).json() == {}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_http_bad_json_is_400(client: TestClient, path: str) -> None:
    resp = client.post(path, content=b'{"prompt": ', headers={"content-type": "application/json"})
    err = _assert_error(resp, 400, "invalid_request_error")
    assert err["message"].startswith("Invalid JSON body") and err["code"] == "invalid_json"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": "abc"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -5}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "echo": 3}, "echo"),
    ({"max_tokens": 5}, "prompt"),
])
def test_http_validation_is_400(client: TestClient, body: dict[str, Any], param: str) -> None:
    err = _assert_error(client.post("/v1/completions", json=body), 400, "invalid_request_error", param)
    assert param in err["message"]


def test_http_manual_validation_is_400(client: TestClient) -> None:
    resp = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": -1})
    _assert_error(resp, 400, "invalid_request_error", "max_tokens")


def test_http_missing_and_non_object_body(client: TestClient) -> None:
    _assert_error(client.post("/v1/completions"), 400, "invalid_request_error")
    _assert_error(client.post("/v1/completions", json=[1, 2]), 400, "invalid_request_error")


def test_http_api_error_and_routing_errors(client: TestClient) -> None:
    err = _assert_error(client.get("/missing-model"), 404, "not_found_error", "model")
    assert err["message"] == "The model 'x' does not exist"
    _assert_error(client.get("/no/such/route"), 404, "not_found_error")
    _assert_error(client.get("/v1/completions"), 405, "invalid_request_error")


def test_http_unexpected_error_is_generic_500(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    err = _assert_error(client.get("/boom"), 500, "server_error")
    assert "secret" not in err["message"]
    assert any("secret internal detail" in str(r.exc_info) for r in caplog.records if r.exc_info)


def test_error_helpers() -> None:
    assert error_body("m", param="p", code="c") == {
        "error": {"message": "m", "type": "invalid_request_error", "param": "p", "code": "c"}}
    assert APIError.unavailable().status == 503 and APIError.unavailable().type == "service_unavailable"
    assert APIError("x", 418).type == "invalid_request_error" and APIError("x", 502).type == "server_error"
    event = APIError.internal().sse_event()
    assert event.startswith("data: ") and json.loads(event[6:])["error"]["type"] == "server_error"


# --------------------------------------------------------------------------
# bench_serving
# --------------------------------------------------------------------------


def test_bench_arg_parsing() -> None:
    args = bench.parse_args(["--endpoint", "chat", "--request-rate", "inf", "--max-concurrency", "4",
                             "--extra-body", '{"top_k": 1}'])
    assert args.endpoint == "chat" and math.isinf(args.request_rate) and args.max_concurrency == 4
    assert args.extra_body == {"top_k": 1} and args.dataset == "random" and args.model is None
    assert bench.parse_args(["--request-rate", "2.5"]).request_rate == 2.5
    with pytest.raises(ValueError, match="range-ratio"):
        bench.make_args(range_ratio=2.0)
    with pytest.raises(TypeError):
        bench.make_args(no_such_option=1)


def test_bench_random_workload() -> None:
    args = bench.make_args(num_prompts=50, input_len=40, output_len=10, range_ratio=0.5, seed=7)
    specs = bench.build_workload(args)
    assert len(specs) == 50 and specs == bench.build_workload(args)  # deterministic per seed
    assert all(20 <= len(s.prompt) == s.prompt_len <= 40 and 5 <= s.output_len <= 10 for s in specs)
    assert all(args.token_id_low <= t < args.token_id_high for s in specs for t in s.prompt)
    assert len({s.prompt_len for s in specs}) > 1
    chat_specs = bench.build_workload(bench.make_args(endpoint="chat", num_prompts=3, input_len=12))
    assert all(isinstance(s.prompt, str) and len(s.prompt.split()) == 12 for s in chat_specs)


def test_bench_shared_prefix_workload() -> None:
    args = bench.make_args(dataset="shared-prefix", num_groups=3, prompts_per_group=4,
                           system_len=20, question_len=5)
    specs = bench.build_workload(args)
    assert len(specs) == 12 and all(len(s.prompt) == 25 for s in specs)
    prefixes = {s.group: s.prompt[:20] for s in specs}
    assert len({tuple(p) for p in prefixes.values()}) == 3
    assert all(s.prompt[:20] == prefixes[s.group] for s in specs)
    assert [s.group for s in specs] != sorted(s.group for s in specs)  # interleaved by default
    chat_args = bench.make_args(endpoint="chat", dataset="shared-prefix", num_groups=2, prompts_per_group=2)
    payload = bench.build_payload(chat_args, "m", bench.build_workload(chat_args)[0])
    assert [m["role"] for m in payload["messages"]] == ["system", "user"]
    assert payload["ignore_eos"] is True and payload["stream_options"] == {"include_usage": True}


def test_bench_metrics() -> None:
    assert bench.percentile([1, 2, 3, 4], 50) == 2.5 and bench.percentile([], 99) == 0.0
    results = [
        bench.RequestResult(ok=True, ttft=0.1, latency=1.1, itl=[0.1] * 10, prompt_tokens=100,
                            output_tokens=11, cached_tokens=50),
        bench.RequestResult(ok=True, ttft=0.3, latency=1.3, itl=[0.1] * 10, prompt_tokens=100,
                            output_tokens=11, cached_tokens=0),
        bench.RequestResult(error="HTTP 500"),
    ]
    m = bench.compute_metrics(results, duration=2.0)
    assert (m["completed"], m["failed"], m["first_errors"]) == (2, 1, ["HTTP 500"])
    assert m["cache_hit_rate"] == 0.25 and m["output_throughput"] == 11.0
    assert m["ttft_ms_mean"] == pytest.approx(200.0) and m["tpot_ms_mean"] == pytest.approx(100.0)
    assert "Cache hit rate" in bench.format_table(m)


def test_bench_against_fake_server(tmp_path: Path) -> None:
    asyncio.run(bench.self_test())

    async def run() -> dict[str, Any]:
        async with bench.fake_server() as (url, _):
            args = bench.make_args(base_url=url, num_prompts=4, input_len=8, output_len=3,
                                   request_rate=1000.0, json_path=str(tmp_path / "out.json"), quiet=True)
            return await bench.run_benchmark(args)

    metrics = asyncio.run(run())
    assert metrics["config"]["model"] == "fake-model"  # discovered via GET /v1/models
    assert json.loads((tmp_path / "out.json").read_text())["completed"] == 4


@pytest.mark.parametrize("chat", [False, True])
def test_plain_chunks_equal_the_chunk_models(chat):
    """The ingress's direct SSE writer for plain streams gives the bytes the pydantic chunk
    models dump: quotes, backslashes, control characters, non-ASCII, emoji, U+2028, empty
    text, first chunks (role) and finish reasons."""
    from deployments.protocol_responses import (
        ChatCompletionStreamChoice, ChatCompletionStreamResponse, CompletionStreamChoice,
        CompletionStreamResponse, DeltaMessage, sse_event,
    )
    from deployments.sse_chunks import PlainChunks

    kind = ChatCompletionStreamResponse if chat else CompletionStreamResponse
    head = kind(model="llama-3 \"8b\"/ü")
    plain = PlainChunks(head, chat)
    base = {"id": head.id, "created": head.created, "model": head.model}
    texts = ["", "hi", ' "quoted" \\ back', "line\nbreak\ttab\r\x00\x1f\x7f", "é ü 中文 😀",
             "\u2028\u2029", "</script>", "{}[],:"]
    for i, text in enumerate(texts):
        for reason in (None, "stop", "length", "abort"):
            for first in (True, False):
                if chat:
                    delta = DeltaMessage(role="assistant" if first else None, content=text or None)
                    choice = ChatCompletionStreamChoice(index=i, delta=delta, finish_reason=reason)
                else:
                    choice = CompletionStreamChoice(index=i, text=text, finish_reason=reason)
                expected = sse_event(kind(**base, choices=[choice]))
                assert plain.event(i, text, reason, first) == expected, (text, reason, first)
