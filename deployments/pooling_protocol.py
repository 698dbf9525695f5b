"""Request and response bodies of the pooling endpoints: OpenAI's `/v1/embeddings`, the
Cohere/Jina-style `/v1/rerank` that vLLM and SGLang accept, and vLLM's `/v1/score`.
Wrong types are errors; unknown fields are dropped, as the generation endpoints do."""
from __future__ import annotations

import base64
import time
import uuid
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

TokenIds = list[StrictInt]
# Inputs (texts, token lists, documents, pairs) one request may carry: OpenAI's embeddings
# limit, so one request cannot hold a replica's forwards for minutes.
MAX_INPUTS = 2048


def _check_count(n: int, what: str) -> None:
    if n > MAX_INPUTS:
        raise ValueError(f"{what} has {n} items, more than the {MAX_INPUTS} a request may "
                         "carry; split it into several requests")


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    # At most this many tokens per input (-1: the model's limit) instead of a 400 for a
    # longer one (vLLM's and SGLang's name).
    truncate_prompt_tokens: int | None = None


class EmbeddingRequest(_Request):
    input: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # Matryoshka models only
    user: str | None = None

    @model_validator(mode="after")
    def _few_enough(self):
        if isinstance(self.input, list) and self.input and not isinstance(self.input[0], int):
            _check_count(len(self.input), "input")
        return self


class RerankDocument(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    text: StrictStr


class RerankRequest(_Request):
    query: StrictStr
    documents: list[StrictStr | RerankDocument]
    top_n: int | None = Field(default=None, ge=0)  # None or 0: every document
    return_documents: bool = True

    @model_validator(mode="after")
    def _few_enough(self):
        _check_count(len(self.documents), "documents")
        return self

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(_Request):
    """vLLM's: `text_1` a string scored against every `text_2`, or two lists paired in order."""

    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]

    @model_validator(mode="after")
    def _few_enough(self):
        for name in ("text_1", "text_2"):
            value = getattr(self, name)
            if isinstance(value, list):
                _check_count(len(value), name)
        return self

    def pairs(self) -> list[tuple[str, str]]:
        first = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        second = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(first) == 1:
            return [(first[0], t) for t in second]
        if len(first) != len(second):
            raise ValueError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give "
                             "one text_1, or as many as text_2")
        return list(zip(first, second))


def _usage(prompt_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def embedding_response(model: str, vectors: list, encoding_format: str, prompt_tokens: int) -> dict:
    def encode(v) -> list[float] | str:
        if encoding_format == "base64":  # float32 little-endian, as OpenAI's
            return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode()
        return v.tolist()

    return {"object": "list", "model": model, "usage": _usage(prompt_tokens),
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)}
                     for i, v in enumerate(vectors)]}


def rerank_response(model: str, req: RerankRequest, scores: list[float], prompt_tokens: int) -> dict:
    texts = req.texts()
    ranked = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    if req.top_n:
        ranked = ranked[:req.top_n]
    results = []
    for i in ranked:
        result = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    return {"id": _id("rerank"), "model": model, "usage": _usage(prompt_tokens), "results": results}


def score_response(model: str, scores: list[float], prompt_tokens: int) -> dict:
    return {"id": _id("score"), "object": "list", "created": int(time.time()), "model": model,
            "usage": _usage(prompt_tokens),
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]}
