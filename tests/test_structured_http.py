"""Structured output through the real Serve app (real Ray, real HTTP, the official openai
client, the tiny random demo model): OpenAI's `response_format` on chat, SGLang's `regex` /
`ebnf` extras on completions, compile errors as HTTP 400s, constrained requests batched
with free ones, and streaming. The schemas and regexes are those of test_structured.py."""
from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import torch

from engine import SamplingParams
from engine.loading.demo_model import ensure_demo_model
from engine.grammar import Grammars
from engine.models import load_hf_config
from engine.loading.tokenizer import Tokenizer
from serve_helpers import BASE, shared_app, stop_ray
from test_structured import PROMPTS, REGEXES, SCHEMAS

MODEL = "radixserve-demo"
EBNF = 'root ::= "(" num ("," num)* ")"\nnum ::= [1-9] [0-9]?'
EBNF_REGEX = r"\([1-9][0-9]?(,[1-9][0-9]?)*\)"
MIN_STOPPED = 0.85  # of constrained choices that must end with "stop" (max_tokens is roomy)


@pytest.fixture(scope="module")
def client():
    shared_app()
    yield openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0, timeout=120)
    stop_ray()


def parallel(fn, items: list) -> list:
    """fn(item) for every item, all in flight at once (the engine batches them)."""
    with ThreadPoolExecutor(max_workers=min(64, len(items))) as pool:
        return list(pool.map(fn, items))


def by_index(response) -> list:
    return sorted(response.choices, key=lambda c: c.index)


def chat(client, prompt: str, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                          **kwargs)


def schema_format(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def count_valid(pairs, check) -> int:
    """pairs of (choice text, finish_reason, spec): check(text, spec) raises/fails on any
    choice that stopped; returns how many stopped."""
    stopped = 0
    for text, reason, spec in pairs:
        assert reason in ("stop", "length"), (reason, spec, text)
        if reason == "stop":
            stopped += 1
            check(text, spec)
    return stopped


def validate_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def match_regex(text: str, pattern: str) -> None:
    assert re.fullmatch(pattern, text), (pattern, text)


# Each constraint: one greedy choice and two seeded samples (one request with n=2).
def _sampler_cases(specs: list) -> list[tuple]:
    cases = []
    for i, spec in enumerate(specs):
        cases.append((i, spec, PROMPTS[i % len(PROMPTS)], dict(temperature=0.0, n=1)))
        cases.append((i, spec, PROMPTS[(i + 1) % len(PROMPTS)],
                      dict(temperature=0.9, top_p=0.95, seed=100 + i, n=2)))
    return cases


def test_chat_json_schema_every_schema(client):
    cases = _sampler_cases(SCHEMAS)

    def send(case):
        i, schema, prompt, kw = case
        r = chat(client, prompt, max_tokens=200, response_format=schema_format(schema, f"s{i}"), **kw)
        assert len(r.choices) == kw["n"]
        return [(c.message.content, c.finish_reason, schema) for c in by_index(r)]

    pairs = [p for ps in parallel(send, cases) for p in ps]
    assert len(pairs) == 3 * len(SCHEMAS) >= 45
    stopped = count_valid(pairs, validate_json)
    assert stopped >= MIN_STOPPED * len(pairs), f"only {stopped}/{len(pairs)} choices finished"


def test_chat_json_object(client):
    def send(seed):
        r = chat(client, PROMPTS[seed % 3], max_tokens=200, response_format={"type": "json_object"},
                 temperature=0.8, seed=seed, n=2)
        return [(c.message.content, c.finish_reason) for c in r.choices]

    outs = [o for os_ in parallel(send, range(3)) for o in os_]
    stopped = 0
    for text, reason in outs:
        assert text.startswith("{"), text  # a JSON object (or its prefix, when cut)
        if reason == "stop":
            stopped += 1
            assert isinstance(json.loads(text), dict), text
    # A random model often writes one endless key string; about half the objects close.
    assert stopped >= 2, f"only {stopped}/{len(outs)} JSON objects finished"


def test_completions_regex_every_regex(client):
    cases = _sampler_cases(REGEXES)

    def send(case):
        _, pattern, prompt, kw = case
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=64,
                                      extra_body={"regex": pattern}, **kw)
        assert len(r.choices) == kw["n"]
        return [(c.text, c.finish_reason, pattern) for c in by_index(r)]

    pairs = [p for ps in parallel(send, cases) for p in ps]
    assert len(pairs) == 3 * len(REGEXES) >= 30
    stopped = count_valid(pairs, match_regex)
    assert stopped >= MIN_STOPPED * len(pairs), f"only {stopped}/{len(pairs)} choices finished"


def test_completions_ebnf(client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=64, temperature=1.0,
                                  seed=7, n=2, extra_body={"ebnf": EBNF})
    pairs = [(c.text, c.finish_reason, EBNF_REGEX) for c in by_index(r)]
    assert len(pairs) == 6
    assert count_valid(pairs, match_regex) >= 4
    # json_schema as an SGLang extra (a JSON string) on completions, too.
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=200, temperature=0,
                                  extra_body={"json_schema": json.dumps(SCHEMAS[0])})
    assert r.choices[0].finish_reason == "stop"
    validate_json(r.choices[0].text, SCHEMAS[0])


# -- errors ---------------------------------------------------------------------------------

BAD = [
    dict(regex="[a-"),
    dict(regex="(a)\\1"),
    dict(json_schema={"type": "object", "properties": {"a": {"type": "foo"}}}),
    dict(json_schema={"type": "integer", "minimum": 5, "maximum": 2}),
    dict(ebnf="root ::= foo"),
]


@pytest.fixture(scope="module")
def compiler_messages() -> list[str]:
    """What the grammar compiler itself says about each BAD constraint (no server)."""
    path = ensure_demo_model()
    tok = Tokenizer(path)
    grammars = Grammars("xgrammar", tok.hf, load_hf_config(path).vocab_size, tok.eos_token_ids,
                        torch.device("cpu"))
    messages = []
    for kwargs in BAD:
        error = grammars.submit(SamplingParams(**kwargs)).exception()
        assert isinstance(error, ValueError)
        messages.append(str(error))
    return messages


def _bad_request(client, kwargs: dict, endpoint: str, stream: bool):
    if endpoint == "chat" and "json_schema" in kwargs:  # OpenAI's way on chat
        return chat(client, "Hello", max_tokens=8, stream=stream,
                    response_format=schema_format(kwargs["json_schema"]))
    if endpoint == "chat":
        return chat(client, "Hello", max_tokens=8, stream=stream, extra_body=kwargs)
    return client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, stream=stream,
                                     extra_body=kwargs)


def test_bad_constraints_are_400_with_the_compilers_message(client, compiler_messages):
    cases = [(k, e, s) for k in range(len(BAD)) for e, s in
             [("completions", False), ("chat", False), ("completions", True)]]

    def send(case):
        k, endpoint, stream = case
        with pytest.raises(openai.BadRequestError) as info:
            _bad_request(client, BAD[k], endpoint, stream)
        return k, info.value

    for k, error in parallel(send, cases):
        assert error.status_code == 400
        message = error.body["message"]
        expected = compiler_messages[k]
        assert expected in message, (BAD[k], message, expected)
        assert re.match(r"invalid (regex|json_schema|ebnf): \S", message), message
    # Specific compiler words, so a generic "bad request" cannot pass.
    assert "Backreference" in compiler_messages[1]
    assert "minimum greater than maximum" in compiler_messages[3]
    assert 'Rule "foo" is not defined' in compiler_messages[4]
    # The server still works, constrained and not.
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=32, temperature=0,
                                  extra_body={"regex": REGEXES[0]})
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(REGEXES[0], r.choices[0].text)
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5


def test_response_format_with_regex_is_rejected(client):
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        chat(client, "Hello", max_tokens=8, response_format={"type": "json_object"},
             extra_body={"regex": "a+"})


# -- batching and streaming ---------------------------------------------------------------------


def test_constrained_and_free_requests_in_one_batch(client):
    free_kw = dict(model=MODEL, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **free_kw).choices[0].text for p in PROMPTS]
    schema, pattern = SCHEMAS[0], REGEXES[6]
    jobs = ([("free", p) for p in PROMPTS] + [("json", p) for p in PROMPTS]
            + [("regex", p) for p in PROMPTS])
    start = threading.Barrier(len(jobs))

    def send(job):
        kind, prompt = job
        start.wait()  # all at once, so the engine runs them in the same steps
        if kind == "free":
            return client.completions.create(prompt=prompt, **free_kw).choices[0]
        extra = {"json_schema": schema} if kind == "json" else {"regex": pattern}
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=200, temperature=0,
                                         extra_body=extra).choices[0]

    outs = parallel(send, jobs)
    assert [c.text for c in outs[:3]] == alone  # constraints in the batch change nothing else
    assert all(c.finish_reason == "length" for c in outs[:3])
    assert count_valid([(c.text, c.finish_reason, schema) for c in outs[3:6]], validate_json) == 3
    assert count_valid([(c.text, c.finish_reason, pattern) for c in outs[6:]], match_regex) == 3


def test_streaming_constrained(client):
    schema = SCHEMAS[1]
    kw = dict(max_tokens=200, temperature=0, response_format=schema_format(schema))
    full = chat(client, PROMPTS[0], **kw).choices[0]
    chunks = list(chat(client, PROMPTS[0], stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.finish_reason == "stop"
    assert text == full.message.content
    validate_json(text, schema)
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1

    pattern = REGEXES[1]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=64, temperature=0.8,
                                            seed=3, stream=True, extra_body={"regex": pattern}))
    texts, reasons = ["", "", ""], [None, None, None]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert count_valid(zip(texts, reasons, [pattern] * 3), match_regex) >= 2
