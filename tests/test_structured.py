"""Structured output on the tiny random model: every constrained output that ends with
"stop" must validate (the model alone would emit garbage), through the offline API."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.runtime.engine import Engine

NAME = {"type": "string", "minLength": 1, "maxLength": 8}
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}

SCHEMAS: list[dict] = [
    # flat object, required fields
    {"type": "object", "properties": {"name": NAME, "age": SMALL_INT}, "required": ["name", "age"]},
    # nested objects
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": SMALL_INT, "nick": NAME},
                 "required": ["id", "nick"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
    # array with min/max items
    {"type": "array", "items": SMALL_INT, "minItems": 1, "maxItems": 4},
    # enum
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"]},
    # numbers with bounds (integer and number)
    {"type": "object", "properties": {
        "t": {"type": "integer", "minimum": -40, "maximum": 50},
        "p": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["t", "p"]},
    # optional fields
    {"type": "object", "properties": {"a": SMALL_INT, "b": NAME, "c": {"type": "boolean"}},
     "required": ["a"]},
    # string pattern
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
     "required": ["code"]},
    # array of objects
    {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"k": NAME, "v": SMALL_INT}, "required": ["k", "v"]}},
    # booleans and nulls
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "none": {"type": "null"}},
     "required": ["ok", "none"]},
    # const
    {"type": "object", "properties": {"version": {"const": 2}, "kind": {"const": "point"}},
     "required": ["version", "kind"]},
    # anyOf
    {"type": "object", "properties": {"id": {"anyOf": [SMALL_INT, NAME]}}, "required": ["id"]},
    # nested arrays
    {"type": "array", "maxItems": 3, "items": {"type": "array", "items": SMALL_INT,
                                               "minItems": 1, "maxItems": 3}},
    # $defs / $ref
    {"$defs": {"pt": {"type": "object", "properties": {"x": SMALL_INT, "y": SMALL_INT},
                      "required": ["x", "y"]}},
     "type": "object", "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}},
     "required": ["from", "to"]},
    # exclusive bounds
    {"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": 0,
                                            "exclusiveMaximum": 10}}, "required": ["n"]},
    # string lengths, no extra properties
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 3, "maxLength": 5}},
     "required": ["s"], "additionalProperties": False},
    # enum of mixed types inside an array
    {"type": "array", "minItems": 2, "maxItems": 2, "items": {"enum": [1, "one", True, None]}},
    # top-level scalar
    {"type": "integer", "minimum": 100, "maximum": 999},
]

REGEXES = [
    r"\d{3}-\d{4}",
    r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)",
    r"(yes|no|maybe)",
    r"[A-Z][a-z]{2,6} [A-Z][a-z]{2,6}",
    r"(0|[1-9][0-9]{0,3})\.[0-9]{2}",
    r"#[0-9a-f]{6}",
    r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    r"(ab|cd){2,5}",
    r"[a-z]{1,5}( [a-z]{1,5}){0,3}",
    r"\((true|false), (true|false)\)",
    r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)",
]

PROMPTS = ["The old lighthouse", "Numbers are everywhere", "She opened the letter"]
# Greedy and two seeded samplers: the random model's choices differ, the grammar holds.
SAMPLERS = [dict(temperature=0.0), dict(temperature=1.0, seed=1), dict(temperature=0.8, top_p=0.9, seed=2)]


def constrained(n: int = 200, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=n, **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(model=tiny_llama, dtype="float32", max_total_tokens=16384)


def replay(llm: LLM, out, params: SamplingParams) -> None:
    """Feed the output's tokens to a fresh matcher of its constraint: the grammar allows
    every one; a "stop" output has ended the grammar, a "length" one is a prefix cut at
    max_tokens (a grammar that ended would have been a stop)."""
    matcher = llm.engine.grammars.submit(params).result().new_matcher()
    assert all(matcher.accept(t) for t in out.token_ids), out
    if out.finish_reason == "stop":
        assert matcher.is_terminated, out
    else:
        assert out.finish_reason == "length", out
        assert len(out.token_ids) == params.max_tokens and not matcher.is_terminated, out


def check_json(llm: LLM, outs, params: list[SamplingParams], schemas) -> int:
    """Replay every output; validate those that stopped; returns how many stopped."""
    stopped = 0
    for o, p, schema in zip(outs, params, schemas, strict=True):
        replay(llm, o, p)
        if o.finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(o.text), schema)
    return stopped


def check_regex(llm: LLM, outs, params: list[SamplingParams], patterns) -> int:
    stopped = 0
    for o, p, pattern in zip(outs, params, patterns, strict=True):
        replay(llm, o, p)
        if o.finish_reason == "stop":
            stopped += 1
            assert re.fullmatch(pattern, o.text), (pattern, o.text)
    return stopped


def test_json_schemas(llm):
    cases = [(s, p, kw) for s in SCHEMAS for p, kw in zip(PROMPTS, SAMPLERS)]
    params = [constrained(json_schema=s, **kw) for s, _, kw in cases]
    outs = llm.generate([p for _, p, _ in cases], params)
    stopped = check_json(llm, outs, params, [s for s, _, _ in cases])
    assert stopped >= 0.9 * len(cases), f"only {stopped}/{len(cases)} outputs finished"


def test_regexes(llm):
    cases = [(r, p, kw) for r in REGEXES for p, kw in zip(PROMPTS, SAMPLERS)]
    params = [constrained(regex=r, **kw) for r, _, kw in cases]
    outs = llm.generate([p for _, p, _ in cases], params)
    stopped = check_regex(llm, outs, params, [r for r, _, _ in cases])
    assert stopped >= 0.9 * len(cases), f"only {stopped}/{len(cases)} outputs finished"


def test_ebnf_and_json_object(llm):
    ebnf = 'root ::= "(" num ("," num)* ")"\nnum ::= [1-9] [0-9]?'
    params = [constrained(ebnf=ebnf, **kw) for kw in SAMPLERS]
    outs = llm.generate(PROMPTS, params)
    assert check_regex(llm, outs, params, [r"\([1-9][0-9]?(,[1-9][0-9]?)*\)"] * len(outs)) >= 2
    params = [constrained(n=60, json_object=True, **kw) for kw in SAMPLERS]
    outs = llm.generate(PROMPTS, params)
    for o, p in zip(outs, params):
        replay(llm, o, p)  # a random model may write one long string: then a JSON prefix
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)


def test_constrained_and_unconstrained_in_one_batch(llm):
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = llm.generate(PROMPTS, free)
    schema = SCHEMAS[0]
    params = [constrained(json_schema=schema, temperature=0.0)] * 3
    mixed = llm.generate(PROMPTS + PROMPTS, [free] * 3 + params)
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in alone]
    assert check_json(llm, mixed[3:], params, [schema] * 3) == 3


def test_cache_hits_with_constraints(llm):
    prompt = "In the market square the baker sold bread, cakes and small sweet rolls. " * 3
    params = constrained(regex=REGEXES[6], temperature=0.0)
    first, = llm.generate(prompt, params)
    second, = llm.generate(prompt, params)
    assert second.cached_tokens > 0.9 * len(second.prompt_token_ids)
    assert second.token_ids == first.token_ids
    assert check_regex(llm, [second], [params], [REGEXES[6]]) == 1


def test_max_tokens_cut_is_length_and_a_valid_prefix(llm):
    schema = SCHEMAS[1]
    params = constrained(n=6, json_schema=schema, temperature=0.0)
    out, = llm.generate("x", params)
    assert out.finish_reason == "length"
    replay(llm, out, params)


@pytest.mark.parametrize("kwargs, message", [
    (dict(regex="[a-"), "invalid regex"),
    (dict(regex="(a)\\1"), "Backreference"),
    (dict(json_schema={"type": "object", "properties": {"a": {"type": "foo"}}}), "invalid json_schema"),
    (dict(json_schema={"type": "integer", "minimum": 5, "maximum": 2}), "minimum greater than maximum"),
    (dict(ebnf="root ::= foo"), 'Rule "foo" is not defined'),
])
def test_bad_constraints_fail_before_queueing(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["fine", "also fine"], [SamplingParams(), SamplingParams(**kwargs)])
    assert llm.stats()["waiting"] == 0 and llm.stats()["running"] == 0


def test_same_constraint_compiles_once(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", max_total_tokens=2048)
    params = [constrained(json_schema=dict(SCHEMAS[3]), temperature=0.0, n=40) for _ in range(3)]
    llm.generate(PROMPTS + ["x"], params + [constrained(json_schema=SCHEMAS[3], n=40)])
    assert llm.engine.grammars.num_compiles == 1


def test_jump_forward_on_and_off(tiny_llama):
    cases = [(s, p, kw) for s in SCHEMAS[:8] for p, kw in zip(PROMPTS, SAMPLERS)]
    totals = {}
    for jump in (True, False):
        llm = LLM(model=tiny_llama, dtype="float32", max_total_tokens=8192, enable_jump_forward=jump)
        params = [constrained(json_schema=s, **kw) for s, _, kw in cases]
        outs = llm.generate([p for _, p, _ in cases], params)
        assert check_json(llm, outs, params, [s for s, _, _ in cases]) >= 0.9 * len(cases)
        totals[jump] = (llm.engine.num_jump_forward_tokens, llm.stats()["steps"])
    assert totals[True][0] > 0 and totals[False][0] == 0
    assert totals[True][1] < totals[False][1]  # fewer decode steps for the same work


def test_preempted_constrained_requests_still_validate(tiny_llama):
    prompts = [f"{p} number {i}" for i in range(4) for p in PROMPTS]
    schemas = [SCHEMAS[i % len(SCHEMAS)] for i in range(len(prompts))]
    params = [constrained(n=80, json_schema=s, temperature=0.0) for s in schemas]
    roomy = LLM(model=tiny_llama, dtype="float32", max_total_tokens=8192).generate(prompts, params)
    tight = LLM(model=tiny_llama, dtype="float32", max_total_tokens=100, chunked_prefill_size=32)
    outs = tight.generate(prompts, params)
    assert tight.stats()["preemptions"] > 0
    assert check_json(tight, outs, params, schemas) >= 0.9 * len(outs)
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]  # matcher state survived


def test_llguidance_fallback_and_backend(tiny_llama, llm):
    # xgrammar rejects minProperties > 0; llguidance compiles it.
    schema = {"type": "object", "properties": {"a": SMALL_INT, "b": SMALL_INT, "c": SMALL_INT},
              "minProperties": 2, "additionalProperties": False}
    params = [constrained(json_schema=schema, **kw) for kw in SAMPLERS]
    outs = llm.generate(PROMPTS, params)
    assert check_json(llm, outs, params, [schema] * 3) >= 2
    only_ll = LLM(model=tiny_llama, dtype="float32", max_total_tokens=8192, grammar_backend="llguidance")
    cases = [(s, kw) for s in SCHEMAS[:6] for kw in SAMPLERS]
    params = [constrained(json_schema=s, **kw) for s, kw in cases]
    outs = only_ll.generate(["Hello"] * len(cases), params)
    assert check_json(only_ll, outs, params, [s for s, _ in cases]) >= 0.8 * len(cases)
    params = [constrained(regex=REGEXES[1], **kw) for kw in SAMPLERS]
    outs = only_ll.generate(["Hello"] * 3, params)
    assert check_regex(only_ll, outs, params, [REGEXES[1]] * 3) >= 2


def test_backend_none_rejects_constraints(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", max_total_tokens=1024, grammar_backend="none")
    with pytest.raises(ValueError, match="grammar_backend='none'"):
        llm.generate("x", SamplingParams(regex="a+"))
    # unconstrained requests run as with a grammar backend
    free = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with_backend = LLM(model=tiny_llama, dtype="float32", max_total_tokens=1024)
    assert llm.generate("x", free)[0].token_ids == with_backend.generate("x", free)[0].token_ids


def test_add_request_without_validate_waits_for_the_compile(llm):
    engine: Engine = llm.engine
    pattern = r"[0-9]{2}:[0-9]{2} (am|pm) on day [1-7]"  # new: compiles in the pool
    req = engine.add_request("direct-1", "The old lighthouse", constrained(regex=pattern))
    while engine.has_work:
        engine.step()
    engine.requests.pop("direct-1")
    assert req.finish_reason == "stop" and re.fullmatch(pattern, engine.output_of(req).text)


def test_benchmark_smoke_on_the_demo_model(tmp_path, monkeypatch):
    """scripts/bench_structured.py at toy sizes: the overhead rows for each constraint and
    batch, and the jump-forward run, whose outputs it validates (it raises on an invalid one)."""
    from bench_scripts import run_script_here

    result = run_script_here("bench_structured.py", "--tokens", "8", "--repeats", "1",
                             "--batch-sizes", "1,2", json_path=tmp_path / "structured.json",
                             monkeypatch=monkeypatch)
    assert {(r["mode"], r["batch"]) for r in result["overhead"]} == {
        (mode, batch) for mode in ("unconstrained", "json_schema", "regex") for batch in (1, 2)}
    assert all(r["wall_ms_per_token"] > 0 and r["tokens_per_request"] == 8 for r in result["overhead"])
    off, on = result["jump_forward"]
    assert (off["jump_forward"], on["jump_forward"]) == (False, True)
    assert off["jump_forward_tokens"] == 0 < on["jump_forward_tokens"]
    assert on["steps"] < off["steps"] and off["stopped"] == off["requests"] > 0
