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
    # Mistral tekken v11+: [TOOL_CALLS]name[ARGS]{...}, one marker per call
    ("mistral", 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}',
     "Checking.", [("get_weather", WEATHER)]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
                '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC", "nested": {"a": "}[ARGS]"}}',
     None, [("get_weather", WEATHER), ("get_time", {"tz": "UTC", "nested": {"a": "}[ARGS]"}})]),
    ("mistral", '[TOOL_CALLS]ping[ARGS]{} and done', "and done", [("ping", {})]),
    ("mistral", "[TOOL_CALLS]this is no function name, just words", "this is no function name, just words", []),
    # Qwen3-Coder XML: raw parameter values, typed by JSON when no schema says otherwise
    ("qwen3_coder", "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>",
     "Let me look.", [("get_weather", WEATHER)]),
    ("qwen3_coder", "<tool_call>\n<function=search>\n<parameter=q>\na < b & </tag>\nline two\n</parameter>\n"
                    "<parameter=n>\n3\n</parameter>\n<parameter=opts>\n{\"deep\": true}\n</parameter>\n"
                    "</function>\n</tool_call>\n<tool_call>\n<function=ping>\n</function>\n</tool_call>",
     None, [("search", {"q": "a < b & </tag>\nline two", "n": 3, "opts": {"deep": True}}), ("ping", {})]),
    ("qwen3_coder", "Use <b>bold</b>, <function> and 4 < 5.", "Use <b>bold</b>, <function> and 4 < 5.", []),
    # Pythonic (Llama 3.2 pythonic template, Llama 4): a list of calls with keyword arguments
    ("pythonic", '[get_weather(city="Paris", unit=\'celsius\'), get_time(tz="a, (b)]", dst=true, n=[1, {"k": None}])]',
     None, [("get_weather", WEATHER), ("get_time", {"tz": "a, (b)]", "dst": True, "n": [1, {"k": None}]})]),
    ("pythonic", '<|python_start|>[ping()]<|python_end|>', None, [("ping", {})]),
    ("pythonic", "[1] is a footnote, [a](b) a link.", "[1] is a footnote, [a](b) a link.", []),
    ("pythonic", "[not a call(1 + )] here", "[not a call(1 + )] here", []),
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


def test_mistral_v11_arguments_stream_before_the_call_ends():
    out = ChatOutput(None, tool_parser("mistral"))
    first = out.feed('[TOOL_CALLS]get_weather[AR')
    assert first.tool_calls == [] and first.content == ""
    second = out.feed('GS] {"city": "Pa')
    assert [(c.name, c.arguments) for c in second.tool_calls] == [("get_weather", '{"city": "Pa')]
    assert out.feed('ris"}', final=True).tool_calls[0].arguments == 'ris"}'
    assert out.finish_reason("stop") == "tool_calls"


def test_qwen3_coder_values_typed_by_the_schema():
    """A string parameter stays as written even when it looks like a number; an integer
    one becomes a number; parameters stream one by one as they close."""
    tools = [{"name": "f", "parameters": {"type": "object", "properties": {
        "zip": {"type": "string"}, "count": {"type": "integer"}, "flag": {"type": "boolean"}}}}]
    out = ChatOutput(None, tool_parser("qwen3_coder", tools))
    first = out.feed("<tool_call>\n<function=f>\n<parameter=zip>\n01234\n</parameter>\n<param")
    assert [(c.name, c.arguments) for c in first.tool_calls] == [("f", '{"zip": "01234"')]
    out.feed("eter=count>\n7\n</parameter>\n<parameter=flag>\nTrue\n</parameter>\n</function>\n"
             "</tool_call>", final=True)
    (call,) = out.message_fields()["tool_calls"]
    assert json.loads(call.function.arguments) == {"zip": "01234", "count": 7, "flag": True}


def test_qwen3_coder_truncated_call_is_closed():
    out = ChatOutput(None, tool_parser("qwen3_coder"))
    out.feed("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2", final=True)
    (call,) = out.message_fields()["tool_calls"]
    assert json.loads(call.function.arguments) == {"a": 1}


def test_pythonic_calls_stream_one_by_one():
    out = ChatOutput(None, tool_parser("pythonic"))
    assert out.feed("[get_").content == ""  # may still open a list of calls: held
    first = out.feed('weather(city="Paris", unit="celsius"), get_ti')
    assert [(c.name, json.loads(c.arguments)) for c in first.tool_calls] == [("get_weather", WEATHER)]
    second = out.feed('me(tz="UTC")]', final=True)
    assert [(c.index, c.name) for c in second.tool_calls] == [(1, "get_time")]
    assert out.finish_reason("stop") == "tool_calls"


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


@pytest.mark.parametrize("text", ['plans </think>{"ok": true}', '<think>plans </think>{"ok": true}'])
def test_reasoning_first_without_an_opening_tag(text):
    """A model known to reason first (its answer's grammar waits for </think>): the text up
    to </think> is reasoning whether or not it wrote <think>."""
    r = parse_all_ways(lambda: ChatOutput(ReasoningParser(False, reasoning_first=True), None), text)
    assert (r["reasoning"], r["content"]) == ("plans ", '{"ok": true}')


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
    assert detect_tool_parser("llama", "[func_name1(params_name1=params_value1)] ipython") == "pythonic"
    coder = "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>"
    assert detect_tool_parser("qwen3_moe", coder) == "qwen3_coder"
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


# -- special-token markers, on a real tokenizer ------------------------------------------

MISTRAL_SPECIALS = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]", "[AVAILABLE_TOOLS]",
                    "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' %}{% if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}"
    "{% else %}{{ m.content }}{% endif %}{{ eos_token }}"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def mistral_tokenizer(tmp_path_factory):
    """The demo tokenizer made Mistral-v0.3-like: [TOOL_CALLS] and the other control
    markers are special tokens (skip_special_tokens drops them), with a template using them."""
    from transformers import AutoTokenizer

    from engine.loading.demo_model import ensure_demo_model
    from engine.loading.tokenizer import Tokenizer

    hf = AutoTokenizer.from_pretrained(ensure_demo_model())
    hf.add_special_tokens({"additional_special_tokens": MISTRAL_SPECIALS})
    hf.chat_template = MISTRAL_TEMPLATE
    out = tmp_path_factory.mktemp("mistral-tokenizer")
    hf.save_pretrained(out)
    return Tokenizer(str(out))


def _mistral_answer(tok, form: str) -> list[int]:
    """'Let me check.' then a call, as a Mistral model writes it (v0.3 array, or tekken
    v11's name[ARGS]{...}), then EOS."""
    marker, args = tok.hf.convert_tokens_to_ids(["[TOOL_CALLS]", "[ARGS]"])
    if form == "v3":
        call = tok.encode('[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]')
    else:
        call = tok.encode("get_weather") + [args] + tok.encode('{"city": "Paris", "unit": "celsius"}')[1:]
    return tok.encode("Let me check.")[1:] + [marker] + call[1:] + [tok.hf.eos_token_id]


@pytest.mark.parametrize("form", ["v3", "v11"])
@pytest.mark.parametrize("stream_step", [None, 1, 3])
def test_mistral_tool_calls_marker_survives_skip_special_tokens(mistral_tokenizer, stream_step, form):
    """Through the ingress's own pieces (ChatFeatures, the per-choice detokenizer, the
    response builders): the [TOOL_CALLS] special token is kept for the parser while EOS and
    other special tokens are still skipped; streamed and whole give the same call."""
    from deployments.chat_request import ChatFeatures
    from deployments.protocol import ChatCompletionRequest
    from deployments.responses import TokenNamer, chat_chunk, chat_response
    from deployments.streams import ChoiceState
    from engine import WireDelta
    from engine.loading.tokenizer import IncrementalDetokenizer

    tok = mistral_tokenizer
    features = ChatFeatures(tok.hf, "mistral", None, None)
    assert features.tool_parser == "mistral"
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Paris?"}],
                                                "tools": [{"type": "function", "function": {
                                                    "name": "get_weather", "parameters": {}}}]})
    plan = features.plan(req)
    prompt = tok.apply_chat_template(plan.messages, plan.tools)
    answer = _mistral_answer(tok, form)

    def reply(keep: bool) -> tuple[dict, dict]:
        choice = ChoiceState(0, 0, IncrementalDetokenizer(tok, prompt, []))
        if keep:
            choice.detok.keep_special(plan.special_tokens)
        output = features.outputs(req, tok.decode(prompt[-8:], False), 1)
        steps = [answer] if stream_step is None else [answer[i:i + stream_step]
                                                       for i in range(0, len(answer), stream_step)]
        streamed = {"content": "", "calls": {}}
        base = {"id": "x", "created": 0, "model": "m"}
        for k, ids in enumerate(steps):
            last = k == len(steps) - 1
            delta = WireDelta("x", ids, last, "stop" if last else None, 0,
                              {"prompt_tokens": len(prompt), "cached_tokens": 0})
            text = choice.add(delta)
            if stream_step is not None:
                d = chat_chunk(base, choice, delta, text, False, TokenNamer(tok), k == 0,
                               output[0]).choices[0]
                streamed["content"] += d.delta.content or ""
                for c in d.delta.tool_calls or []:
                    got = streamed["calls"].setdefault(c.index, {"name": None, "arguments": ""})
                    got["name"] = got["name"] or c.function.name
                    got["arguments"] += c.function.arguments or ""
                streamed["finish"] = d.finish_reason
        if stream_step is None:
            whole = chat_response("m", [choice], False, TokenNamer(tok), output).choices[0]
            streamed = {"content": whole.message.content or "", "finish": whole.finish_reason,
                        "calls": {i: {"name": c.function.name, "arguments": c.function.arguments}
                                  for i, c in enumerate(whole.message.tool_calls or [])}}
        return streamed, {"text": "".join(choice.text)}

    kept, raw = reply(keep=True)
    assert "[TOOL_CALLS]" in raw["text"] and "</s>" not in raw["text"]
    assert kept["content"] == "Let me check." and kept["finish"] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in kept["calls"].values()] == [
        ("get_weather", WEATHER)]
    # Decoded as before (every special token skipped), the marker is gone and so is the call.
    lost, raw = reply(keep=False)
    assert "[TOOL_CALLS]" not in raw["text"] and not lost["calls"]


def test_kept_special_tokens_are_only_the_parsers_markers(mistral_tokenizer):
    tok = mistral_tokenizer
    keep = tok.special_token_ids(["[TOOL_CALLS]", "<think>", "not a token"])
    assert keep == {tok.hf.convert_tokens_to_ids("[TOOL_CALLS]")}  # <think>: not in this vocab
    ids = [tok.hf.bos_token_id, *keep, tok.hf.convert_tokens_to_ids("[INST]"), tok.hf.eos_token_id]
    assert tok.decode(ids, keep=keep) == "[TOOL_CALLS]"
    assert tok.decode(ids) == "" and tok.decode(ids, skip_special_tokens=False).count("[") == 2
