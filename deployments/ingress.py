"""The OpenAI-compatible HTTP ingress (FastAPI under `@serve.ingress`): validates and
tokenizes (the router hashes token prefixes), fans each request out into one engine call per
(prompt, choice), and streams or gathers the results."""

import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve

from deployments.admission import engine_replica_ids, install_admission
from deployments.auth import install_auth
from deployments.channel import ChannelHub
from deployments.engine_replica import EngineCall, resolve_model
from deployments.ingress_parts import IngressParts, PartsLoader, PartsSource
from deployments.errors import APIError, as_api_error, install_error_handlers
from deployments.gc_thread import collect_on_own_thread
from deployments.lora_api import install_lora_api
from deployments.readiness import install_readiness
from deployments.sampling_defaults import model_sampling_defaults, with_defaults
from deployments.request_body import DEFAULT_MAX_BODY_BYTES, read_json_body
from deployments.metrics import install_http_metrics, record_gc_pauses
from deployments.scrape import ingress_snapshot, install_prometheus_endpoint
from deployments.stats import FleetStats
from deployments.sse_chunks import PlainChunks
from deployments.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from deployments.protocol_responses import (SSE_DONE, ChatCompletionStreamResponse,
                                            CompletionStreamResponse, ModelCard, ModelList, sse_event)
from deployments.request_sampling import chat_sampling_kwargs, completion_sampling_kwargs
from deployments import sglang_api, task_routes
from deployments.responses import (chat_chunk, chat_response, completion_chunk,
                                   completion_response, usage_of)
from deployments.streams import ChoiceState, error_of, merge_deltas, merged_stream, prepend
from engine import (
    ChatPrompt, IncrementalDetokenizer, SamplingParams, Tokenizer, freeze_after_start,
    validate_request,
)

api = FastAPI(title="radixserve", description="OpenAI-compatible API over radixserve engines")
install_error_handlers(api)
# Middleware added last runs first: metrics, the key check, readiness, then admission.
admission = install_admission(api)  # fed by the delta channels (deployments/admission.py)
parts_loader = PartsLoader()  # the tokenizer etc., loaded after the constructor (ingress_parts.py)
readiness = install_readiness(api, parts_loader)  # Serve's running engine replicas, and those parts
auth = install_auth(api)  # keys set by the ingress constructor
install_http_metrics(api)
prometheus = install_prometheus_endpoint(api)  # GET /metrics; configured by the constructor
task_routes.install_pooling_refusals(api)  # /v1/embeddings etc.: 400, the pooling app serves them
lora_admin = install_lora_api(api)  # LoRA adapters' load/unload (deployments/lora_api.py)


@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, engine_handle, model: str | None, served_model_name: str,
                 max_model_len: int | None = None, tokenizer: str | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 router_reads_text: bool = False, api_key: str | None = None,
                 admin_api_key: str | None = None, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None,
                 max_calls_in_flight: int | None = None, freeze_gc: bool = True) -> None:
        collect_on_own_thread()  # never inside Serve's context-variable sets (gc_thread.py)
        auth.configure(api_key, admin_api_key)
        # A request's engine calls (prompts x n) in flight at once: the engine's batch, so a
        # larger request runs through it in turn (deployments/streams.py, merged_stream).
        self.max_calls_in_flight = max_calls_in_flight
        path = resolve_model(model)
        self.model_path, self.tokenizer_path = path, tokenizer or path
        self.sampling_defaults = model_sampling_defaults(path)  # generation_config.json
        self.engine = engine_handle.options(stream=True)
        self.control = engine_handle
        lora_admin.configure(engine_handle)
        self.lora_api = lora_admin  # this app's own (serve.ingress freezes a copy of the app)
        admission.replicas = lambda: engine_replica_ids(self.engine)
        # An engine in this process (deployments/colocated.py): deltas on each call's own iterator,
        # no channel, no hop for 503s (read off the type: a handle answers any attribute).
        in_process = getattr(type(engine_handle), "in_process", False)
        self.hub = None if in_process else ChannelHub(  # (the stream handle routes from its first call)
            self.engine, loads=admission, replicas=lambda: engine_replica_ids(self.engine, self.control))
        if in_process:  # its engine is built before Serve lets this replica take requests
            readiness.answered = True
        else:
            readiness.follow(admission.replicas, self.control.load.remote)
        prometheus.configure(served_model_name, self.metrics_snapshot, None if in_process else self.control)
        self.fleet = FleetStats(engine_handle, in_process)  # /v1/stats
        self.model_name = served_model_name
        self.max_body_bytes = max_body_bytes
        # Ray's PrefixCacheAffinityRouter reads prompt text; ours hashes token ids, and
        # decoding every prompt again for nothing costs the event loop ~1 ms per 2k tokens.
        self.router_reads_text = router_reads_text
        self.freeze_gc = freeze_gc
        source = PartsSource(path, self.tokenizer_path, max_model_len, tool_call_parser,
                             reasoning_parser)
        # At launch, on a thread: this replica answers probes meanwhile (ingress_parts.py).
        parts_loader.load(source, self._adopt, on_thread=not in_process)

    def _adopt(self, parts: IngressParts) -> None:
        self.tokenizer, self.vocab_size = parts.tokenizer, parts.vocab_size
        self.max_context, self.name_token = parts.max_context, parts.name_token
        self.encoder, self.chat_features = parts.encoder, parts.chat_features
        # Every stream through this replica waits out a full garbage collection: ~300 ms
        # over the libraries and tokenizer loaded by now (2-core box), unless frozen
        # (`freeze_gc`: the engine's freeze_gc_after_start).
        freeze_after_start(self, self.freeze_gc)
        record_gc_pauses()  # (after the freeze: serving's pauses only)

    def check_health(self) -> None:
        """Serve replaces a replica whose parts failed to load (its /health says why)."""
        if parts_loader.error is not None:
            raise RuntimeError(f"the ingress could not load its parts: {parts_loader.error}")

    # -- plain endpoints ----------------------------------------------------------------

    @api.get("/health")
    async def health(self) -> JSONResponse:
        """200 once an engine replica can serve; until then the readiness middleware
        answers 503 (deployments/readiness.py), as it does for /v1/models."""
        return JSONResponse({"status": "ok"})

    @api.get("/v1/models")
    async def models(self) -> ModelList:  # the base model, then its LoRA adapters
        return ModelList(data=await lora_admin.model_cards(self.model_name, self.max_context))

    @api.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str) -> ModelCard:
        return await lora_admin.model_card(model_id, self.model_name, self.max_context)

    @api.get("/v1/stats")
    async def stats(self) -> JSONResponse:
        """Engine counters summed over all replicas, per replica, and the router's."""
        return JSONResponse(await self.fleet.summary())

    def router_counters(self) -> dict | None:  # /v1/stats asks every ingress replica
        return self.fleet.router_counters()

    async def metrics_snapshot(self) -> dict:  # this replica's part of GET /metrics
        return ingress_snapshot(self.control)

    @api.post("/flush_cache")
    @api.get("/flush_cache")  # SGLang takes both
    async def flush_cache(self) -> JSONResponse:
        await self.control.flush_cache.remote()
        return JSONResponse({"status": "ok"})

    @api.post("/tokenize")
    async def tokenize(self, request: Request) -> JSONResponse:
        """Token ids of a prompt exactly as /v1/completions sees it. With `messages`, the chat
        template is rendered and `prompt` is returned too: text that, sent to /v1/completions,
        gives the tokens /v1/chat/completions uses (the frontend language builds chats on it)."""
        req = TokenizeRequest.model_validate(await self._body(request))
        if isinstance(req.prompt, str):
            return JSONResponse({"tokens": await self._encode(req.prompt),
                                 "max_model_len": self.max_context})
        if req.prompt is not None:  # a batch: one token list per text
            return JSONResponse({"tokens": [await self._encode(p) for p in req.prompt],
                                 "max_model_len": self.max_context})
        messages = [m.as_template_dict() for m in req.messages]
        chat = await self._render_chat(messages, add_generation_prompt=req.add_generation_prompt)
        return JSONResponse({"tokens": chat.token_ids, "count": len(chat.token_ids),
                             "prompt": chat.text, "max_model_len": self.max_context})

    # -- generation ---------------------------------------------------------------------

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        req = CompletionRequest.model_validate(await self._body(request))
        kwargs = completion_sampling_kwargs(req) | self._check_model(req.model)
        raw_prompts = req.prompts()
        prompts = [await self._token_ids(p) for p in raw_prompts]
        calls, choices = self._calls(prompts, kwargs, req.n, "cmpl")
        want_lp = req.logprobs is not None
        echo = None
        if req.echo:
            texts = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in raw_prompts]
            echo = [(prompts[i // req.n], texts[i // req.n]) for i in range(len(calls))]
        if req.stream:
            return await self._stream(calls, choices, req.include_usage, chat=False,
                                      want_lp=want_lp, echo=echo)
        return await self._answer(calls, choices, lambda: completion_response(
            self.model_name, choices, want_lp, self.name_token, echo))

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        req = ChatCompletionRequest.model_validate(await self._body(request))
        lora = self._check_model(req.model)
        try:
            plan = self.chat_features.plan(req)
        except ValueError as e:
            raise APIError.bad_request(str(e)) from None
        chat = await self._render_chat(plan.messages, plan.tools, plan.template_kwargs)
        prompt = chat.token_ids
        tail = self.tokenizer.decode(prompt[-8:], skip_special_tokens=False)
        kwargs = chat_sampling_kwargs(req, default_max_tokens=max(1, self.max_context - len(prompt)))
        kwargs.update(plan.sampling, **lora, **self.chat_features.answer_sampling(req, tail))
        calls, choices = self._calls([prompt], kwargs, req.n, "chatcmpl")
        for c in choices:  # special tokens the output's parsers read stay in its text
            c.detok.keep_special(plan.special_tokens)
        outputs = self.chat_features.outputs(req, tail, len(choices))
        want_lp = bool(req.logprobs)
        if req.stream:
            return await self._stream(calls, choices, req.include_usage, chat=True, want_lp=want_lp,
                                      outputs=outputs)
        return await self._answer(calls, choices, lambda: chat_response(
            self.model_name, choices, want_lp, self.name_token, outputs))

    # -- SGLang's native API (deployments/sglang_api.py) ---------------------------------

    @api.get("/get_model_info")
    @api.get("/model_info")
    async def sglang_model_info(self) -> JSONResponse:
        return JSONResponse(sglang_api.model_info(self.model_path, self.tokenizer_path,
                                                  self.model_name, self.sampling_defaults or None))

    @api.get("/get_server_info")
    @api.get("/server_info")
    async def sglang_server_info(self) -> JSONResponse:
        info = {"model_path": self.model_path, "served_model_name": self.model_name,
                "context_length": self.max_context}
        return JSONResponse(sglang_api.server_info(info, await self.fleet.summary()))

    @api.get("/health_generate")
    async def health_generate(self) -> JSONResponse:
        """Healthy when the engine generates a token (SGLang's deep health check)."""
        prompt = [self.tokenizer.hf.bos_token_id or 0]
        calls, choices = self._calls([prompt], {"max_tokens": 1, "ignore_eos": True}, 1, "health")
        await self._gather(calls, choices)
        return JSONResponse({"status": "ok"})

    @api.post("/generate")
    @api.put("/generate")
    async def generate(self, request: Request):
        req = sglang_api.GenerateRequest.model_validate(await self._body(request))
        lora = self._check_model(req.model)
        prompts = [await self._token_ids(p) for p in req.prompts()]
        plans = [self._sglang_plan(req, i, len(ids)) for i, ids in enumerate(prompts)]
        calls, choices = [], []
        for i, (ids, plan) in enumerate(zip(prompts, plans)):
            more_calls, more = self._calls([ids], {**lora, **plan.kwargs}, plan.n, "gen")
            for c in more:
                c.index, c.prompt_index = len(choices), i
                choices.append(c)
            calls += more_calls
        builder = sglang_api.OutputBuilder(self.tokenizer, self.tokenizer.eos_token_ids,
                                           req.return_text_in_logprobs)

        def output(c: ChoiceState) -> dict:
            return builder.output(c, plans[c.prompt_index], prompts[c.prompt_index],
                                  plans[c.prompt_index].rid or calls[c.index].request_id)

        if req.stream:
            batches, stream = await self._open(calls)
            render = output if len(choices) == 1 else lambda c: {**output(c), "index": c.index}
            return StreamingResponse(sglang_api.sse_outputs(batches, stream, choices, render),
                                     media_type="text/event-stream")

        def body() -> JSONResponse:
            outputs = [output(c) for c in choices]
            return JSONResponse(outputs if req.is_batch or len(outputs) > 1 else outputs[0])

        return await self._answer(calls, choices, body)

    # -- helpers ------------------------------------------------------------------------

    @staticmethod
    def _sglang_plan(req, i: int, prompt_len: int):
        try:
            return sglang_api.plan_prompt(req, i, prompt_len)
        except ValidationError as e:
            raise as_api_error(e) from None
        except ValueError as e:
            raise APIError.bad_request(str(e)) from None

    def _merged(self, calls: list[EngineCall]):
        return merged_stream(self.engine, calls, self.hub, self.max_calls_in_flight)

    async def _open(self, calls: list[EngineCall]):
        """(batches, stream): the merged stream with its first batch read already, so that
        errors before any token get a real HTTP status; close `stream` when done."""
        stream = self._merged(calls)
        first = await anext(stream, None)
        if first is not None and (err := error_of(first[0][1])) is not None:
            await stream.aclose()
            raise err
        return prepend(first, stream), stream

    async def _body(self, request: Request) -> Any:
        return await read_json_body(request, self.max_body_bytes)

    async def _encode(self, text: str) -> list[int]:
        try:
            return await self.encoder.encode(text)
        except ValueError as e:
            raise APIError.bad_request(str(e), param="prompt") from None

    async def _render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                           template_kwargs: dict | None = None,
                           add_generation_prompt: bool = True) -> ChatPrompt:
        try:
            return await self.encoder.render_chat(messages, tools, add_generation_prompt,
                                                  **(template_kwargs or {}))
        except ValueError as e:
            raise APIError.bad_request(str(e), param="messages") from None
        except Exception as e:  # noqa: BLE001 - the template is the model's code; its errors are the client's
            raise APIError.bad_request(f"chat template error: {e}", param="messages") from None

    def _check_model(self, model: str | None) -> dict[str, str]:
        """Another model than the base is a LoRA adapter (unknown: the engine's 404)."""
        return {} if model is None or model == self.model_name else {"lora": model}

    async def _token_ids(self, prompt: str | list[int]) -> list[int]:
        return await self._encode(prompt) if isinstance(prompt, str) else list(prompt)

    def _calls(self, prompts: list[list[int]], kwargs: dict[str, Any], n: int,
               prefix: str) -> tuple[list[EngineCall], list[ChoiceState]]:
        """One engine call per (prompt, choice), its SamplingParams validated here, once."""
        kwargs = with_defaults(kwargs, self.sampling_defaults)
        try:
            params = SamplingParams(**kwargs)
            for ids in prompts:
                validate_request(ids, params, self.vocab_size, self.max_context)
            per_choice = [params if params.seed is None or j == 0  # n seeded choices must differ
                          else replace(params, seed=params.seed + j) for j in range(n)]
        except (ValueError, TypeError) as e:
            raise APIError.bad_request(str(e)) from None
        rid = f"{prefix}-{uuid.uuid4().hex}"
        calls, choices = [], []
        for i, ids in enumerate(prompts):
            text = self.tokenizer.decode(ids, skip_special_tokens=False) if self.router_reads_text else ""
            for j in range(n):
                calls.append(EngineCall(f"{rid}-{i}-{j}", ids, per_choice[j], prompt=text))
                detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.skip_special_tokens,
                                               params.include_stop_str_in_output)
                choices.append(ChoiceState(index=len(choices), prompt_index=i, detok=detok))
        return calls, choices

    async def _gather(self, calls: list[EngineCall], choices: list[ChoiceState]) -> None:
        async for batch in self._merged(calls):
            for i, item in batch:
                if (err := error_of(item)) is not None:
                    raise err
                choices[i].add(item)

    async def _answer(self, calls: list[EngineCall], choices: list[ChoiceState],
                      build: Callable[[], Any]) -> Any:
        """A non-streamed answer: every choice gathered, then `build()`. Nothing is written
        before it is whole, so an error at any point keeps its own status. A client that
        leaves meanwhile is seen on the receive channel (HAProxy resets the replica's
        connection, Serve's proxy forwards the disconnect), and Serve cancels this call."""
        await self._gather(calls, choices)
        return build()

    async def _stream(self, calls: list[EngineCall], choices: list[ChoiceState],
                      include_usage: bool, chat: bool, want_lp: bool, echo=None,
                      outputs=None) -> StreamingResponse:
        batches, stream = await self._open(calls)  # errors before any token: a real status
        events = self._sse(batches, stream, choices, include_usage, chat, want_lp, echo, outputs)
        return StreamingResponse(events, media_type="text/event-stream")

    async def _sse(self, batches, stream, choices, include_usage, chat, want_lp,
                   echo=None, outputs=None) -> AsyncIterator[str]:
        """One SSE write per batch of deltas: a client (or proxy) slower than the engine
        gets fewer, larger chunks (one per choice per batch), not a backlog of one-token ones."""
        kind = ChatCompletionStreamResponse if chat else CompletionStreamResponse
        head = kind(model=self.model_name)
        base = {"id": head.id, "created": head.created, "model": self.model_name}
        started = [False] * len(choices)
        plain = PlainChunks(head, chat) if not want_lp and echo is None and not outputs else None
        try:
            async for batch in batches:
                events, error = [], None
                for i, item in merge_deltas(batch):
                    if (error := error_of(item)) is not None:
                        break
                    text = choices[i].add(item)
                    if plain is not None:
                        reason = item.finish_reason if item.finished else None
                        events.append(plain.event(i, text, reason, not started[i]))
                        started[i] = True
                        continue
                    if chat:
                        chunk = chat_chunk(base, choices[i], item, text, want_lp, self.name_token,
                                           not started[i], outputs[i] if outputs else None)
                    else:
                        chunk = completion_chunk(base, choices[i], item, text, want_lp, self.name_token,
                                                 echo[i] if echo is not None else None, not started[i])
                    started[i] = True
                    events.append(sse_event(chunk))
                if error is not None:
                    events.append(error.sse_event())
                    yield "".join(events)
                    break
                yield "".join(events)
            if include_usage:
                yield sse_event(kind(**base, choices=[], usage=usage_of(choices)))
            yield SSE_DONE
        finally:
            await stream.aclose()
