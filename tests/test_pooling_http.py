"""The pooling endpoints through real Ray Serve and HTTP: serve_config_rag.yaml's two apps
(generation at /, all-MiniLM-L6-v2 embeddings at /embed) plus a tiny random
BertForSequenceClassification reranker app at /rank, each answering on its own route;
embeddings through the official openai client equal sentence-transformers'; rerank and score
equal transformers' logits; bad input is a 4xx that leaves the app serving."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch
import yaml

from serve_helpers import BASE, ROOT, deploy_all, start_ray, stop_ray
from test_pooling import SENTENCES, assert_embeddings_equal, tiny_reranker  # noqa: F401

pytestmark = pytest.mark.slow
EMBED, RANK = f"{BASE}/embed", f"{BASE}/rank"


@pytest.fixture(scope="module")
def apps(tiny_reranker):  # noqa: F811 - the fixture imported above
    config = yaml.safe_load((ROOT / "serve_config_rag.yaml").read_text())
    start_ray()
    try:
        apps = []
        for app in config["applications"]:
            args = dict(app["args"], ray_actor_options={"num_cpus": 0.2})
            if app["name"] == "radixserve":  # the tiny demo model stands in for SmolLM2
                args.update(model=None, served_model_name="radixserve-demo", ingress="colocated",
                            engine={"max_total_tokens": 512, "max_running_requests": 4})
            apps.append((app["name"], app["route_prefix"], args))
        apps.append(("rerank", "/rank", {"model": tiny_reranker, "served_model_name": "tiny-reranker",
                                         "ray_actor_options": {"num_cpus": 0.2},
                                         "engine": {"task": "score"}}))
        deploy_all(apps)
        yield config
    finally:
        stop_ray()


def test_openai_client_embeddings_equal_sentence_transformers(apps):
    from sentence_transformers import SentenceTransformer

    from engine.loading.model_source import resolve_model_path

    client = openai.OpenAI(base_url=f"{EMBED}/v1", api_key="none")
    out = client.embeddings.create(model="all-minilm-l6-v2", input=SENTENCES)
    ref = SentenceTransformer(resolve_model_path("package:all_minilm_l6_v2"),
                              device="cpu").encode(SENTENCES, convert_to_tensor=True)
    assert [d.index for d in out.data] == list(range(len(SENTENCES)))
    assert_embeddings_equal([d.embedding for d in out.data], ref)
    assert out.usage.prompt_tokens == out.usage.total_tokens > len(SENTENCES) * 2
    # base64 (the openai client's own default when numpy is installed) and token-id inputs
    raw = httpx.post(f"{EMBED}/v1/embeddings", json={"input": SENTENCES[0], "encoding_format": "base64"})
    vec = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype="<f4")
    assert_embeddings_equal([vec.tolist()], ref[:1])
    ids = httpx.post(f"{BASE}/tokenize", json={"prompt": "x"})  # the generation app's route
    assert ids.status_code == 200
    by_ids = client.embeddings.create(model="all-minilm-l6-v2", input=[[101, 7592, 2088, 102]])
    assert len(by_ids.data[0].embedding) == 384


def test_two_apps_answer_on_their_own_routes(apps):
    gen = httpx.post(f"{BASE}/v1/completions", json={"model": "radixserve-demo", "prompt": "hi",
                                                       "max_tokens": 3}, timeout=60)
    assert gen.status_code == 200 and gen.json()["usage"]["completion_tokens"] >= 1
    models = httpx.get(f"{EMBED}/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["all-minilm-l6-v2"]
    # Each task's endpoints on the other app: a 400 naming the task, not a 404.
    wrong = httpx.post(f"{BASE}/v1/embeddings", json={"input": "x"})
    assert wrong.status_code == 400 and "task 'embed'" in wrong.json()["error"]["message"]
    wrong = httpx.post(f"{EMBED}/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}]})
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "wrong_task"
    wrong = httpx.post(f"{EMBED}/v1/rerank", json={"query": "q", "documents": ["d"]})
    assert wrong.status_code == 400 and "task 'score'" in wrong.json()["error"]["message"]


def test_rerank_and_score_equal_transformers_logits(apps, tiny_reranker):  # noqa: F811
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    query = "what does a radix cache store?"
    docs = ["prompt prefixes as a tree of token ids", "bananas", "a long document " * 20,
            "KV slots of shared prefixes"]
    tok = AutoTokenizer.from_pretrained(tiny_reranker)
    hf = AutoModelForSequenceClassification.from_pretrained(tiny_reranker).eval()
    with torch.no_grad():
        ref = hf(**tok([query] * len(docs), docs, padding=True, return_tensors="pt")).logits[:, 0]
    body = httpx.post(f"{RANK}/v1/rerank", json={
        "model": "tiny-reranker", "query": query, "documents": [docs[0], {"text": docs[1]}, *docs[2:]],
        "top_n": 3}).json()
    results = body["results"]
    assert [r["index"] for r in results] == ref.argsort(descending=True)[:3].tolist()
    for r in results:
        assert abs(r["relevance_score"] - ref[r["index"]].item()) < 1e-4
        assert r["document"]["text"] == docs[r["index"]]
    assert body["usage"]["prompt_tokens"] > len(docs) * 5
    score = httpx.post(f"{RANK}/v1/score", json={"text_1": query, "text_2": docs}).json()
    assert torch.allclose(torch.tensor([d["score"] for d in score["data"]]), ref, atol=1e-4)


@pytest.mark.parametrize("route, body, status, words", [
    ("/embed/v1/embeddings", {"input": ""}, 400, "empty"),
    ("/embed/v1/embeddings", {"input": []}, 400, "empty"),
    ("/embed/v1/embeddings", {"input": "word " * 400}, 400, "truncate_prompt_tokens"),
    ("/embed/v1/embeddings", {"input": "x", "dimensions": 8}, 400, "Matryoshka"),
    ("/embed/v1/embeddings", {"input": [[10 ** 9]]}, 400, "token ids"),
    ("/embed/v1/embeddings", {"input": 5}, 400, "input"),
    ("/embed/v1/embeddings", {"input": "x", "model": "other"}, 404, "does not exist"),
    ("/rank/v1/rerank", {"query": "", "documents": ["d"]}, 400, "non-empty"),
    ("/rank/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400, "text_1"),
    ("/embed/v1/embeddings", {"input": ["x"] * 2049}, 400, "split it"),
    ("/embed/v1/embeddings", {"input": [[5]] * 2049}, 400, "split it"),
    ("/rank/v1/rerank", {"query": "q", "documents": ["d"] * 2049}, 400, "split it"),
    ("/rank/v1/score", {"text_1": "q", "text_2": ["d"] * 2049}, 400, "split it"),
])
def test_bad_input_is_a_clear_4xx(apps, route, body, status, words):
    r = httpx.post(f"{BASE}{route}", json=body)  # the route alone names the case: ports vary
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]


def test_truncation_usage_and_metrics(apps):
    r = httpx.post(f"{EMBED}/v1/embeddings", json={"input": "word " * 400, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 256
    metrics = httpx.get(f"{EMBED}/metrics").text
    assert 'radixserve:pooling_requests_total{model_name="all-minilm-l6-v2",outcome="ok",task="embed"}' in metrics
    assert 'outcome="invalid",task="embed"' in metrics
    assert "radixserve:pooling_prompt_tokens_total" in metrics
    stats = httpx.get(f"{EMBED}/v1/stats").json()
    assert stats["task"] == "embed" and stats["prompt_tokens"] >= 256
