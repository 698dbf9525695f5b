"""Tool-call and reasoning parsers on real model-format strings (no Ray, no model).

Each case is fed whole (the non-streamed path) and in every split into pieces of 1, 2, 3,
5 and 7 characters (streaming): the streamed pieces must concatenate to the whole result,
and the whole result must be the expected content and calls."""
from __future__ import annotations

import json

import jsonschema
import pytest

from deployments.chat_output import ChatOutput
from deployments.reasoning import ReasoningParser, detect_reasoning_parser, prompt_opens_reasoning
from deployments.tool_calls import (
    NamedToolParser, RequiredToolParser, detect_tool_parser, tool_parser,
)
from deployments.tool_calls.grammar import named_schema, required_schema
from deployments.tool_calls.json_scan import ObjectScanner

WEATHER = {"city": "Paris", "unit": "celsius"}
SPLITS = (1, 2, 3, 5, 7)


def run(output: ChatOutput, text: str, step: int | None) -> dict:
    """Feed `text` in pieces of `step` characters (None: whole); the message it gives, and
    the streamed deltas reassembled the way an OpenAI client does."""
    pieces = [text] if step is None else [text[i:i + step] for i in range(0, len(text), step)]
    streamed = {"reasoning": "", "content": "", "calls": {}}
    for k, piece in enumerate(pieces):
        d = output.feed(piece, final=k == len(pieces) - 1)
        streamed["reasoning"] += d.reasoning
        streamed["content"] += d.content
        for c in d.tool_calls:
            call = streamed["calls"].setdefault(c.index, {"name": None, "arguments": "", "ids": 0})
            if c.id is not None:
                assert call["ids"] == 0, "a call's id and name come once, first"
                call["ids"], call["name"] = 1, c.name
            call["arguments"] += c.arguments
    message = output.message_fields()
    calls = [(c.function.name, c.function.arguments) for c in message["tool_calls"] or []]
    assert calls == [(c["name"], c["arguments"]) for _, c in sorted(streamed["calls"].items())]
    assert (message["content"] or "") == streamed["content"]
    assert (message["reasoning_content"] or "") == streamed["reasoning"]
    return {"content": message["content"], "reasoning": message["reasoning_content"],
            "calls": [(n, json.loads(a)) for n, a in calls]}


def parse_all_ways(make, text: str) -> dict:
    results = [run(make(), text, step) for step in (None, *SPLITS)]
    for r in results[1:]:
        assert r == results[0]
    return results[0]


def tools_output(name: str):
    return lambda: ChatOutput(None, tool_parser(name))


CASES = [
    # Qwen2.5 / Qwen3 / Hermes: text, then one block per call
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     None, [("get_weather", WEATHER)]),
    ("hermes", 'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
     "Let me check both.", [("get_weather", WEATHER), ("get_time", {"tz": "Europe/Paris"})]),
    ("hermes", '<tool_call>\n{"arguments": {"q": "a \\"}\\" b", "n": [1, {"x": null}]}, "name": "search"}\n</tool_call>',
     None, [("search", {"q": 'a "}" b', "n": [1, {"x": None}]})]),
    ("hermes", "The answer is 4 < 5, plainly.", "The answer is 4 < 5, plainly.", []),
    # Llama 3.1-3.3: the output is the JSON call, "parameters", optional <|python_tag|>, ';' between
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     None, [("get_weather", WEATHER)]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
               '{"name": "get_time", "parameters": {}}',
     None, [("get_weather", WEATHER), ("get_time", {})]),
    ("llama3", 'Paris is in France. {"name": "x"} is not a call here.',
     'Paris is in France. {"name": "x"} is not a call here.', []),
    ("llama3", '{"type": "function", "name": "ping"}', None, [("ping", {})]),
    # Mistral v0.3: [TOOL_CALLS] then a JSON array
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": {"tz": "UTC"}}]',
     None, [("get_weather", WEATHER), ("get_time", {"tz": "UTC"})]),
    ("mistral", "Bonjour! [1, 2] is a list.", "Bonjour! [1, 2] is a list.", []),
]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_model_formats(name, text, content, calls):
    r = parse_all_ways(tools_output(name), text)
    assert r["calls"] == calls
    assert r["content"] == content
    assert r["reasoning"] is None


def test_call_ids_are_unique_and_prefixed():
    out = ChatOutput(None, tool_parser("hermes"))
    out.feed('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>', final=True)
    ids = [c.id for c in out.message_fields()["tool_calls"]]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


def test_truncated_call_keeps_its_partial_arguments():
    # max_tokens cut the call: the name and the arguments so far are kept (finish_reason length)
    out = ChatOutput(None, tool_parser("hermes"))
    out.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', final=True)
    msg = out.message_fields()
    assert [(c.function.name, c.function.arguments) for c in msg["tool_calls"]] == [
        ("get_weather", '{"city": "Par')]
    assert out.finish_reason("length") == "length"
    assert out.finish_reason("stop") == "tool_calls"


def test_arguments_stream_before_the_call_ends():
    out = ChatOutput(None, tool_parser("hermes"))
    first = out.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert [(c.name, c.arguments) for c in first.tool_calls] == [("get_weather", '{"city": "Pa')]
    assert out.feed('ris"}}\n</tool_call>').tool_calls[0].arguments == 'ris"}'


def test_marker_prefix_is_held_back_not_leaked():
    out = ChatOutput(None, tool_parser("hermes"))
    assert out.feed("Sure <tool_").content == "Sure"
    assert out.feed('call>{"name": "f", "arguments": {}}</tool_call>', final=True).content == ""


# -- forced tool choice (grammar output) -----------------------------------------------


def test_required_output_is_a_json_array_of_calls():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, {"name": "get_time", "parameters": {"tz": "UTC"}}]'
    r = parse_all_ways(lambda: ChatOutput(None, RequiredToolParser()), text)
    assert r["calls"] == [("get_weather", WEATHER), ("get_time", {"tz": "UTC"})]
    assert r["content"] is None


def test_named_output_is_the_arguments():
    r = parse_all_ways(lambda: ChatOutput(None, NamedToolParser("get_weather")), json.dumps(WEATHER))
    assert r["calls"] == [("get_weather", WEATHER)]


FUNCS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {
             "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
             "required": ["city"]}},
         {"name": "get_time"}]


def test_grammar_schemas_accept_calls_and_refuse_others():
    schema = required_schema(FUNCS, parallel=True)
    jsonschema.validate([{"name": "get_weather", "parameters": WEATHER},
                         {"name": "get_time", "parameters": {}}], schema)
    for bad in ([], [{"name": "nope", "parameters": {}}],
                [{"name": "get_weather", "parameters": {"unit": "kelvin"}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    two = [{"name": "get_time", "parameters": {}}] * 2
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(two, required_schema(FUNCS, parallel=False))
    assert named_schema(FUNCS[0]) == FUNCS[0]["parameters"]
    assert named_schema(FUNCS[1])["type"] == "object"


# -- reasoning ------------------------------------------------------------------------------


def reasoning_output(starts: bool, tools: str | None = None):
    return lambda: ChatOutput(ReasoningParser(starts), tool_parser(tools) if tools else None)


def test_qwen3_think_block_is_split_off():
    r = parse_all_ways(reasoning_output(False), "<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.")
    assert r["reasoning"] == "\nThe user wants 2+2.\n" and r["content"] == "It is 4."


def test_prompt_opened_reasoning_deepseek_r1_style():
    r = parse_all_ways(reasoning_output(True), "Hmm, 2+2 is 4.</think>\n\nFour.")
    assert r["reasoning"] == "Hmm, 2+2 is 4." and r["content"] == "Four."
    r = parse_all_ways(reasoning_output(True), "still thinking when max_tokens hit")
    assert r["reasoning"] == "still thinking when max_tokens hit" and r["content"] is None


def test_no_think_block_is_all_content():
    r = parse_all_ways(reasoning_output(False), "  <thin air is not a tag")
    assert r["content"] == "  <thin air is not a tag" and r["reasoning"] is None


def test_reasoning_then_tool_call():
    text = ('<think>\nI need the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>')
    r = parse_all_ways(reasoning_output(False, "hermes"), text)
    assert r["reasoning"] == "\nI need the weather.\n"
    assert r["calls"] == [("get_weather", WEATHER)] and r["content"] is None


def test_prompt_tail_detection():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")


# -- selection ------------------------------------------------------------------------------


def test_parser_chosen_from_template_then_model_type():
    assert detect_tool_parser("llama", "{{ '<tool_call>' }} tools") == "hermes"
    assert detect_tool_parser("llama", "tools {{ '<|python_tag|>' }}") == "llama3"
    assert detect_tool_parser("mistral", "[TOOL_CALLS] tools") == "mistral"
    assert detect_tool_parser("qwen2", "{% if tools %}{% endif %}") == "hermes"
    assert detect_tool_parser("llama", "{% if tools %}custom{% endif %}") is None
    assert detect_tool_parser("llama", "plain ChatML") == "hermes"  # tools described by chat_render
    assert detect_reasoning_parser("<think>{{ x }}</think>") == "qwen3"
    assert detect_reasoning_parser("plain") is None
    with pytest.raises(ValueError):
        tool_parser("nope")


def test_object_scanner_spans():
    s = ObjectScanner()
    rest = s.feed('{"name": "f", "n": 12, "arguments": {"a": [1, {"x": "}"}]}} tail')
    assert s.done and rest == " tail"
    assert s.value("n") == "12" and s.value("arguments") == '{"a": [1, {"x": "}"}]}'
    with pytest.raises(ValueError):
        ObjectScanner().feed("nope")
