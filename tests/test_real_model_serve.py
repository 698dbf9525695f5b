"""The README's first command on the default model (SmolLM2-135M-Instruct): `bash
scripts/serve.sh serve_config.yaml` (`serve run` in Ray Serve's high-throughput mode) as a
subprocess, then OpenAI-style requests a new user would send."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import jsonschema
import pytest

from serve_helpers import ROOT, end_ray, served_model_name, wait_until
from serve_helpers import kill_session as _kill_session

pytestmark = pytest.mark.slow
URL = "http://127.0.0.1:8000"
START_LIMIT_S = 150  # the goal is < 60 s (README); CI machines are shared, so allow slack


def _ready(proc) -> bool | str:
    if proc.poll() is not None:
        return "exited"
    try:
        # /v1/models answers 200 once an engine replica serves (503 engine_starting before)
        return httpx.get(f"{URL}/v1/models", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def server():
    end_ray()  # the session's cluster would hold port 8000
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(ROOT))
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # its `serve`
    start = time.monotonic()
    proc = subprocess.Popen(["bash", "scripts/serve.sh", "serve_config.yaml"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        state = wait_until(lambda: _ready(proc), timeout=START_LIMIT_S, interval=0.5)
        if state is not True:
            out = proc.stdout.read().decode(errors="replace") if proc.poll() is not None else ""
            pytest.fail(f"serve run did not come up in {START_LIMIT_S} s ({state}): {out[-3000:]}")
        print(f"\nscripts/serve.sh serve_config.yaml: ingress up after {time.monotonic() - start:.1f} s")
        yield httpx.Client(base_url=URL, timeout=120)
    finally:
        _kill_session(proc.pid)
        proc.wait(timeout=30)
        time.sleep(1)


def _chat(client, messages, **extra) -> dict:
    r = client.post("/v1/chat/completions", json={"model": served_model_name(), "messages": messages,
                                                 "temperature": 0, "max_tokens": 48, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_answers_a_factual_question(server):
    body = _chat(server, [{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in body["choices"][0]["message"]["content"], body
    assert body["choices"][0]["finish_reason"] == "stop"


def test_multi_turn_chat_reuses_the_previous_turns(server):
    history = [{"role": "user", "content": "Name a large animal that lives in the ocean."}]
    first = _chat(server, history, max_tokens=24)
    history += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                {"role": "user", "content": "How long can it hold its breath?"}]
    second = _chat(server, history, max_tokens=8)
    # The first turn's prompt (system + user + the assistant opening) is in the radix cache.
    first_prompt = first["usage"]["prompt_tokens"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first_prompt <= cached < second["usage"]["prompt_tokens"], (first["usage"], second["usage"])


def test_json_schema_response_validates(server):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "country": {"type": "string", "maxLength": 30},
                                               "is_capital": {"type": "boolean"}},
              "required": ["city", "country", "is_capital"], "additionalProperties": False}
    body = _chat(server, [{"role": "user", "content": "Give facts about Paris as JSON."}], max_tokens=64,
                 response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    value = json.loads(body["choices"][0]["message"]["content"])  # bounded fields: it must finish
    jsonschema.validate(value, schema)
    assert value["city"] == "Paris", value
