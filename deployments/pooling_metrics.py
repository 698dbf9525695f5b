"""The pooling app's own metrics (requests by task and outcome, prompt tokens, request
latency), served by each pooling replica at `GET /metrics` in Prometheus' text format.
HTTP requests by route and their durations are Ray metrics as on the generation app
(deployments/metrics.py's middleware)."""
from __future__ import annotations

import time

from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class PoolingMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        labels = ["model_name", "task"]
        self.requests = Counter("radixserve:pooling_requests", "Pooling requests by task "
                                "(embed, score, rerank) and outcome (ok, invalid, rejected, "
                                "cancelled, error).", labels + ["outcome"], registry=self.registry)
        self.prompt_tokens = Counter("radixserve:pooling_prompt_tokens", "Tokens run through "
                                     "the model by finished pooling requests.", labels,
                                     registry=self.registry)
        self.inputs = Counter("radixserve:pooling_inputs", "Inputs (texts, token lists or "
                              "query-document pairs) of finished pooling requests.", labels,
                              registry=self.registry)
        self.latency = Histogram("radixserve:pooling_request_duration_seconds", "Pooling "
                                 "request time from its body being read to its answer.", labels,
                                 buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.model_name = model_name

    def record(self, task: str, outcome: str, started: float, inputs: int = 0,
               tokens: int = 0) -> None:
        self.requests.labels(self.model_name, task, outcome).inc()
        if outcome == "ok":
            self.prompt_tokens.labels(self.model_name, task).inc(tokens)
            self.inputs.labels(self.model_name, task).inc(inputs)
            self.latency.labels(self.model_name, task).observe(time.monotonic() - started)

    def response(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
