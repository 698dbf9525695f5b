"""The pooling app (`engine.task: embed` or `score`): one deployment that serves HTTP and
runs its PoolingEngine in process, as `ingress: colocated` does for generation. A pooling
request is one forward with nothing cached after it, so there is no prefix to route by and
no stream to carry: Serve's proxy (or HAProxy) balances replicas by load, and each replica
packs the requests in flight into shared forwards (engine `AsyncPooling`).

Endpoints: `/v1/embeddings` (OpenAI), `/v1/rerank` and `/rerank` (Cohere/Jina, as vLLM and
SGLang accept), `/v1/score` and `/score` (vLLM); `/v1/models`, `/health`, `/v1/stats`,
`/metrics`. Generation endpoints answer 400 (deployments/task_routes.py)."""

import asyncio
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from ray import serve

from deployments.auth import install_auth
from deployments.errors import APIError, as_api_error, install_error_handlers
from deployments.gc_thread import collect_on_own_thread
from deployments.metrics import install_http_metrics
from deployments.pooling_metrics import PoolingMetrics
from deployments.pooling_protocol import (
    EmbeddingRequest, RerankRequest, ScoreRequest, embedding_response, rerank_response,
    score_response,
)
from deployments.protocol_responses import ModelCard, ModelList
from deployments.request_body import DEFAULT_MAX_BODY_BYTES, read_json_body
from deployments.task_routes import task_error
from engine import (
    AsyncPooling, EngineConfig, PoolingEngine, PoolingQueueFull, embedding_inputs, pair_inputs,
)

pooling_api = FastAPI(title="radixserve pooling", description="Embeddings, rerank and score")
install_error_handlers(pooling_api)
auth = install_auth(pooling_api)
install_http_metrics(pooling_api)


# Module helpers come before the class: `serve.ingress` captures globals when applied.
def _tokens(items) -> int:
    return sum(len(x.ids) for x in items)


@serve.ingress(pooling_api)
class PoolingServer:
    def __init__(self, model: str | None, engine_kwargs: dict[str, Any], served_model_name: str,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, api_key: str | None = None,
                 admin_api_key: str | None = None) -> None:
        collect_on_own_thread()  # never inside Serve's context-variable sets (gc_thread.py)
        auth.configure(api_key, admin_api_key)
        if not model:
            raise ValueError("a pooling app (task embed or score) needs `model`")
        self.engine = PoolingEngine(EngineConfig(model=model, **engine_kwargs))
        self.pooling = AsyncPooling(self.engine)
        self.model_name = served_model_name
        self.max_body_bytes = max_body_bytes
        self.metrics = PoolingMetrics(served_model_name)

    @pooling_api.get("/health")
    async def health(self) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @pooling_api.get("/v1/models")
    async def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, max_model_len=self.engine.max_context)])

    @pooling_api.get("/v1/stats")
    async def stats(self) -> JSONResponse:
        return JSONResponse({**self.engine.stats_dict(), "waiting": self.pooling.waiting})

    @pooling_api.get("/metrics")
    async def prometheus(self):
        return self.metrics.response()

    @pooling_api.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> JSONResponse:
        req, started = await self._parse(request, EmbeddingRequest, "embed")
        items = await self._checked("embed", started, lambda: self._embed_items(req))
        vectors = await self._run("embed", started, items, req.dimensions)
        return JSONResponse(embedding_response(self.model_name, vectors, req.encoding_format,
                                               _tokens(items)))

    @pooling_api.post("/v1/rerank")
    @pooling_api.post("/rerank")
    async def rerank(self, request: Request) -> JSONResponse:
        req, started = await self._parse(request, RerankRequest, "score", "rerank")
        pairs = [(req.query, d) for d in req.texts()]
        items = await self._checked("rerank", started, lambda: pair_inputs(
            self.engine, pairs, req.truncate_prompt_tokens))
        scores = await self._run("rerank", started, items)
        return JSONResponse(rerank_response(self.model_name, req, scores, _tokens(items)))

    @pooling_api.post("/v1/score")
    @pooling_api.post("/score")
    async def score(self, request: Request) -> JSONResponse:
        req, started = await self._parse(request, ScoreRequest, "score")
        items = await self._checked("score", started, lambda: pair_inputs(
            self.engine, req.pairs(), req.truncate_prompt_tokens))
        scores = await self._run("score", started, items)
        return JSONResponse(score_response(self.model_name, scores, _tokens(items)))

    @pooling_api.post("/v1/completions")
    @pooling_api.post("/v1/chat/completions")
    @pooling_api.post("/generate")
    async def generation(self, request: Request) -> JSONResponse:
        raise task_error(request.url.path, self.engine.task)

    # -- helpers ------------------------------------------------------------------------

    async def _parse(self, request: Request, kind: type[BaseModel], needs: str,
                     label: str | None = None) -> tuple[Any, float]:
        """(the request's body as `kind`, when it started); a 400 for the wrong task or a
        bad body, a 404 for another model's name."""
        label, started = label or needs, time.monotonic()
        if self.engine.task != needs:
            self.metrics.record(label, "invalid", started)
            raise task_error(request.url.path, self.engine.task)
        try:
            req = kind.model_validate(await read_json_body(request, self.max_body_bytes))
        except ValidationError as e:
            self.metrics.record(label, "invalid", started)
            raise as_api_error(e) from None
        if req.model is not None and req.model != self.model_name:
            raise APIError.not_found(f"The model '{req.model}' does not exist; this server serves "
                                     f"'{self.model_name}'", param="model")
        return req, started

    def _embed_items(self, req: EmbeddingRequest):
        self.engine.check_dimensions(req.dimensions)
        return embedding_inputs(self.engine, req.input, req.truncate_prompt_tokens)

    async def _checked(self, task: str, started: float, make):
        """Tokenized and checked inputs, off the event loop; a bad one is a 400 before any
        forward (nothing queued, nothing held)."""
        try:
            return await asyncio.to_thread(make)
        except ValueError as e:
            self.metrics.record(task, "invalid", started)
            raise APIError.bad_request(str(e), param="input") from None

    async def _run(self, task: str, started: float, items, dimensions: int | None = None) -> list:
        try:
            out = await self.pooling.run(items, dimensions)
        except PoolingQueueFull:
            self.metrics.record(task, "rejected", started)
            raise APIError.unavailable() from None
        except asyncio.CancelledError:
            self.metrics.record(task, "cancelled", started)
            raise
        except Exception:
            self.metrics.record(task, "error", started)
            raise
        self.metrics.record(task, "ok", started, len(items), _tokens(items))
        return out

    def check_health(self) -> None:
        if not self.pooling.is_alive():
            raise RuntimeError("the pooling worker thread has died")

    def __del__(self) -> None:
        pooling = getattr(self, "pooling", None)
        if pooling is not None:
            pooling.shutdown(timeout=0)

