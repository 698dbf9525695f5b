"""Tool calling and reasoning through the real Serve app (real Ray, real HTTP, the official
openai client) on the tiny random demo model, given a Qwen3-style chat template that renders
tools, tool calls, tool results and think blocks (written here, in the fixture).

A random model never chooses to call a tool, so calls are made with tool_choice "required"
or a named function: the grammar built from the function schemas shapes the output, and
every call must parse and validate. Reasoning is split on output forced by a regex."""
from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from engine.loading.demo_model import ensure_demo_model
from serve_helpers import BASE, run_app, serve_config_args, start_ray, stop_ray

pytestmark = pytest.mark.slow

MODEL = "tools-demo"
TEMPLATE = """{{ bos_token }}
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
Call a function with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|im_start|>assistant
{% if message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content or '' }}
{%- for call in message.tool_calls or [] %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% elif open_thinking is defined and open_thinking %}<think>
{% endif %}{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "tz": {"enum": ["UTC", "CET"]}, "dst": {"type": "boolean"}}, "required": ["tz", "dst"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tools-model") / "model"
    shutil.copytree(ensure_demo_model(), out)
    (out / "chat_template.jinja").write_text(TEMPLATE)
    # The tiny tokenizer spells JSON in many tokens: room for the tools block (random
    # weights, so longer positions mean nothing more).
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(config, max_position_embeddings=2048,
                                                     vocab_size=config["vocab_size"] + 2)))
    _add_think_tokens(out, config["vocab_size"])
    return out


def _add_think_tokens(model_dir, vocab_size: int) -> None:
    """<think> and </think> as tokens of their own (not special), as in Qwen3's vocabulary:
    two more rows of (random) embedding and LM head, two added tokens."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(model_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = weights[name]
        weights[name] = torch.cat([w, torch.randn(2, w.shape[1], generator=gen).to(w.dtype) * w.std()])
    save_file(weights, model_dir / "model.safetensors")
    hf = AutoTokenizer.from_pretrained(model_dir)
    hf.add_tokens(["<think>", "</think>"])
    hf.save_pretrained(model_dir)
    assert hf.convert_tokens_to_ids(["<think>", "</think>"]) == [vocab_size, vocab_size + 1]


@pytest.fixture(scope="module")
def client(model_dir):
    start_ray()
    run_app(serve_config_args(model=str(model_dir), served_model_name=MODEL, ingress_replicas=1,
                              engine={"max_running_requests": 32, "max_total_tokens": 8192}))
    yield openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0, timeout=120)
    stop_ray()


def chat(client, messages=ASK, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def streamed(client, messages=ASK, **kwargs) -> dict:
    """A streamed response put back together as an OpenAI client user would."""
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for chunk in chat(client, messages, stream=True, **kwargs):
        for choice in chunk.choices:
            d = choice.delta
            out["content"] += d.content or ""
            out["reasoning"] += getattr(d, "reasoning_content", None) or ""
            for c in d.tool_calls or []:
                call = out["calls"].setdefault(c.index, {"id": None, "name": None, "arguments": ""})
                if c.id:
                    assert call["id"] is None, "id and name come once, in a call's first delta"
                    call["id"], call["name"] = c.id, c.function.name
                call["arguments"] += c.function.arguments or ""
            out["finish"] = choice.finish_reason or out["finish"]
    return out


def check_calls(message, n_max: int | None = None) -> list[tuple[str, dict]]:
    calls = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        calls.append((call.function.name, args))
    assert calls and (n_max is None or len(calls) <= n_max)
    return calls


def test_required_calls_always_validate(client):
    r = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=6,
             temperature=1.0, seed=7, max_tokens=200)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        check_calls(choice.message, n_max=1)
        assert choice.message.content is None


def test_parallel_required_calls(client):
    r = chat(client, tools=TOOLS, tool_choice="required", temperature=1.0, seed=3, n=4,
             max_tokens=400)
    stopped = [c for c in r.choices if c.finish_reason == "tool_calls"]
    assert len(stopped) >= 3, [c.finish_reason for c in r.choices]  # a random model may run long
    for choice in stopped:
        check_calls(choice.message)


def test_named_function_call(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    r = chat(client, tools=TOOLS, tool_choice=choice, n=4, temperature=1.0, seed=1, max_tokens=100)
    for c in r.choices:
        assert c.finish_reason == "tool_calls"
        assert [name for name, _ in check_calls(c.message, n_max=1)] == ["get_time"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_reassemble_to_the_whole(client, tool_choice):
    kwargs = dict(tools=TOOLS, tool_choice=tool_choice, temperature=0.0, max_tokens=200)
    whole = chat(client, **kwargs).choices[0]
    parts = streamed(client, **kwargs)
    assert parts["finish"] == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(parts["calls"].items())] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert parts["content"] == "" and whole.message.content is None


def test_call_then_tool_result_then_answer(client, model_dir):
    """The agent loop: the call goes back as an assistant turn, the result as a tool turn;
    both reach the prompt exactly as the HF template renders them (tools included)."""
    first = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                 temperature=0.0, max_tokens=200).choices[0].message
    call = first.tool_calls[0]
    history = ASK + [first.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "RESULT-sunny-21C"}]
    answer = chat(client, history, tools=TOOLS, max_tokens=8, temperature=0.0)
    assert answer.choices[0].finish_reason in ("stop", "length")

    hf = AutoTokenizer.from_pretrained(model_dir)
    rendered_history = [dict(m) for m in history]
    rendered_history[1]["tool_calls"] = [{"id": call.id, "type": "function", "function": {
        "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]
    text = hf.apply_chat_template(rendered_history, tools=TOOLS, tokenize=False,
                                  add_generation_prompt=True)
    assert "RESULT-sunny-21C" in text and f'"name": "{call.function.name}"' in text
    assert answer.usage.prompt_tokens == len(hf.encode(text, add_special_tokens=False))


def test_reasoning_split_whole_and_streamed(client):
    regex = r"<think>\n[a-z]{2,8}( [a-z]{2,8}){0,3}\n</think>\n\n[a-z]{2,8}( [a-z]{2,8}){0,2}"
    kwargs = dict(temperature=0.0, max_tokens=120, extra_body={"regex": regex})
    whole = chat(client, **kwargs).choices[0]
    assert whole.finish_reason == "stop"
    reasoning, content = whole.message.reasoning_content, whole.message.content
    assert reasoning.startswith("\n") and reasoning.endswith("\n") and content
    assert "<think>" not in reasoning + content and "</think>" not in reasoning + content
    parts = streamed(client, **kwargs)
    assert (parts["reasoning"], parts["content"]) == (reasoning, content)


def test_enable_thinking_false_reaches_the_template(client):
    on = chat(client, max_tokens=4, temperature=0.0)
    off = chat(client, max_tokens=4, temperature=0.0,
               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # The template closes an empty think block in the prompt: more prompt tokens, and the
    # output is all content.
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    assert off.choices[0].message.reasoning_content is None
    assert isinstance(off.choices[0].message.content, str)


def test_tool_choice_auto_streams_like_the_whole(client):
    kwargs = dict(tools=TOOLS, temperature=0.0, max_tokens=24)
    whole = chat(client, **kwargs).choices[0]
    parts = streamed(client, **kwargs)
    assert parts["content"] == (whole.message.content or "")
    assert parts["finish"] == whole.finish_reason


def test_tool_choice_none_hides_tools(client):
    plain = chat(client, max_tokens=2)
    hidden = chat(client, tools=TOOLS, tool_choice="none", max_tokens=2)
    shown = chat(client, tools=TOOLS, max_tokens=2)
    assert hidden.usage.prompt_tokens == plain.usage.prompt_tokens < shown.usage.prompt_tokens
    assert hidden.choices[0].message.tool_calls is None


@pytest.mark.parametrize("body", [
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
    {"tool_choice": "required"},
    {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
    {"chat_template_kwargs": {"tokenize": True}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
     "tool_choice": "required"},
])
def test_bad_tool_requests_are_400(client, body):
    r = httpx.post(f"{BASE}/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": ASK, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]


def test_chat_echo_leads_with_the_assistant_message_it_continues(client):
    """echo (vLLM's): the content starts with the last message's when that message is the
    assistant's, whole and streamed; after a user message there is nothing to echo."""
    partial = ASK + [{"role": "assistant", "content": "The weather in Paris is"}]
    kwargs = dict(temperature=0.0, max_tokens=6)
    plain = chat(client, partial, **kwargs).choices[0].message.content or ""
    echoed = chat(client, partial, extra_body={"echo": True}, **kwargs).choices[0].message
    assert echoed.content == "The weather in Paris is" + plain
    assert streamed(client, partial, extra_body={"echo": True}, **kwargs)["content"] == echoed.content
    after_user = chat(client, extra_body={"echo": True}, **kwargs).choices[0].message.content
    assert after_user == chat(client, **kwargs).choices[0].message.content


@pytest.mark.parametrize("thinking", [{"open_thinking": True}, {"enable_thinking": True}])
def test_structured_output_applies_to_the_answer_after_reasoning(client, model_dir, thinking):
    """The model reasons first (the prompt opens a think block: this template's
    `open_thinking`; or thinking is asked for: enable_thinking): it reasons freely and only
    the answer after </think> follows response_format, whole and streamed. (logit_bias on
    the </think> token makes the random model close its reasoning early.)"""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    end = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids("</think>")
    kwargs = dict(temperature=0.0, max_tokens=60, logit_bias={str(end): 6},
                  response_format={"type": "json_schema",
                                   "json_schema": {"name": "answer", "schema": schema}})
    thought = chat(client, extra_body={"chat_template_kwargs": thinking}, **kwargs).choices[0]
    assert thought.finish_reason == "stop"
    reasoning = thought.message.reasoning_content
    assert reasoning and "{" not in reasoning  # not the grammar's: free text
    jsonschema.validate(json.loads(thought.message.content), schema)
    parts = streamed(client, extra_body={"chat_template_kwargs": thinking}, **kwargs)
    assert (parts["reasoning"], parts["content"]) == (reasoning, thought.message.content)
    # Without a think block opened, the grammar holds from the first token: no </think>.
    direct = chat(client, **kwargs).choices[0].message
    assert direct.reasoning_content is None
    jsonschema.validate(json.loads(direct.content), schema)
