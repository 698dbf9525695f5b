"""Structured output under speculative decoding (n-gram drafts): drafts are cut where the
grammar refuses them, ends, or would jump forward, every verified position is masked, greedy outputs equal plain
constrained decoding token for token (both grammar backends, jump-forward on and off),
and sampled outputs follow the same distribution as plain constrained sampling."""
from __future__ import annotations

import collections
import json
import math
import re

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.request import Request
from engine.speculative.constrained import cut_to_grammar, verify_masks
from engine.speculative.proposer import Proposer
from engine.core.step_plan import Chunk
from test_overlap import assert_no_leak
from test_speculative import SPEC

PROMPT = "The old lighthouse stood"
ENUM_ARRAY = {"type": "array", "items": {"type": "string", "enum": ["alpha", "beta", "gamma"]},
              "minItems": 5, "maxItems": 12}
NESTED = {"type": "object", "properties": {
    "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                              "nick": {"type": "string", "maxLength": 8}},
             "required": ["id", "nick"]},
    "active": {"type": "boolean"}}, "required": ["user", "active"]}
CONSTRAINED = [dict(regex=r"[a-z ]{10,70}"), dict(regex=r"(ab|cd|ef| )+"),
               dict(json_schema=ENUM_ARRAY), dict(json_schema=NESTED), dict(json_object=True)]


@pytest.fixture(scope="module")
def looping_model(tiny_model_factory) -> str:
    return tiny_model_factory("llama", init_std=0.02)


def a_request(llm: LLM, **constraint) -> Request:
    """A request (never added) with its matcher ready."""
    eng = llm.engine
    params = SamplingParams(max_tokens=20, temperature=0.0, **constraint)
    grammar = eng.grammars.submit(params) if params.has_constraint else None
    req = Request("probe", eng.tokenize_prompt(PROMPT), params, grammar=grammar)
    if grammar is not None:
        eng.grammars.matcher_of(req)
    return req


def letters(llm: LLM, text: str) -> list[int]:
    return llm.engine.tokenizer.encode(text)[1:]  # without BOS


def test_drafts_are_cut_where_the_grammar_refuses_or_ends(looping_model):
    llm = LLM(model=looping_model, dtype="float32", max_total_tokens=1024)
    req = a_request(llm, regex=r"(ab|cd){2,3}")
    eos = min(llm.engine.tokenizer.eos_token_ids)
    before = verify_masks(llm.engine.grammars, [Chunk(req, 0, 1)])
    assert cut_to_grammar(llm.engine.grammars, req, letters(llm, "abcx")) == letters(llm, "abc")
    assert cut_to_grammar(llm.engine.grammars, req, letters(llm, "abcdab")) == letters(llm, "abcdab")
    # "abcdab" fills the grammar's last repetition: a stop token would end it, so it is left out.
    assert cut_to_grammar(llm.engine.grammars, req, letters(llm, "abcdab") + [eos]) == letters(llm, "abcdab")
    assert cut_to_grammar(llm.engine.grammars, req, letters(llm, "x")) == []
    # The walks leave the matcher where it was.
    assert torch.equal(verify_masks(llm.engine.grammars, [Chunk(req, 0, 1)]), before)


@pytest.mark.parametrize("jump_forward", [True, False])
def test_drafts_stop_before_a_jump_forward_point(looping_model, jump_forward):
    """After "q" the regex forces " the lighthouse": plain decoding with jump-forward appends
    that text instead of decoding it, so a draft must not carry "q" (its verified span would
    run past the jump); without jump-forward the same draft is kept whole."""
    llm = LLM(model=looping_model, dtype="float32", max_total_tokens=1024,
              enable_jump_forward=jump_forward)
    grammars = llm.engine.grammars
    req = a_request(llm, regex=r"q( the lighthouse)")
    draft = letters(llm, "q the")
    matcher = grammars.matcher_of(req)
    assert matcher.accept(draft[0])
    assert grammars.would_jump(req, draft[0]) == jump_forward
    matcher.rollback(1)
    assert cut_to_grammar(grammars, req, draft) == ([] if jump_forward else draft)
    logprobs = a_request(llm, regex=r"q( the lighthouse)")
    logprobs.params.logprobs = True  # requests asking for logprobs never jump
    assert cut_to_grammar(grammars, logprobs, draft) == draft


def test_verify_masks_follow_the_draft(looping_model):
    llm = LLM(model=looping_model, dtype="float32", max_total_tokens=1024)
    grammars = llm.engine.grammars
    req = a_request(llm, regex=r"(ab|cd){2,3}")
    free = a_request(llm)
    a, b, c = letters(llm, "abc")
    chunk = Chunk(req, 0, 1)
    chunk.draft = [a, b]
    other = Chunk(free, 0, 1)
    other.draft = [c]
    masks = verify_masks(grammars, [chunk, other])
    assert masks.shape == (3 + 2, grammars.vocab_size)
    allowed = [set(row.nonzero().flatten().tolist()) for row in masks]
    assert allowed[0] == set(letters(llm, "a") + letters(llm, "c"))  # at the start: "ab" or "cd"
    assert allowed[1] == {b}  # after "a": only "b"
    assert allowed[2] == set(letters(llm, "a") + letters(llm, "c"))  # after "ab": the second repetition
    assert allowed[3] == allowed[4] == set(range(grammars.vocab_size))  # unconstrained rows
    assert verify_masks(grammars, [other]) is None


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("jump_forward", [True, False])
def test_constrained_greedy_equals_plain_and_speculates(looping_model, backend, jump_forward):
    params = [SamplingParams(max_tokens=120, temperature=0.0, **c) for c in CONSTRAINED]
    params.append(SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    prompts = [PROMPT] * len(params)
    kw = dict(model=looping_model, dtype="float32", max_total_tokens=4096, grammar_backend=backend,
              enable_jump_forward=jump_forward)
    plain = LLM(**kw).generate(prompts, params)
    llm = LLM(**kw, **SPEC)
    spec = llm.generate(prompts, params)
    for a, b in zip(spec, plain):
        assert (a.token_ids, a.finish_reason, a.text) == (b.token_ids, b.finish_reason, b.text)
    assert re.fullmatch(CONSTRAINED[0]["regex"], spec[0].text)
    assert len(json.loads(spec[2].text)) >= 5
    if jump_forward:
        # Drafts stop before a token after which the grammar forces text (plain decoding
        # jumps there): the enum array, forced after every choice, drafts nothing; the free
        # text speculates.
        assert spec[2].speculative["spec_drafted_tokens"] == 0, spec[2].speculative
        assert sum(o.speculative["spec_accepted_tokens"] for o in spec) > 10
    else:
        # The enum array repeats itself: its drafts are kept, under the grammar.
        assert spec[2].speculative["spec_accepted_tokens"] > 10, spec[2].speculative
    assert_no_leak(llm.stats())


class ScriptedDrafts(Proposer):
    """After each letter, propose the letters that follow it in "abcdefab...": often what
    the grammar allows (kept with the target's probability), often not (cut)."""

    def __init__(self, llm: LLM) -> None:
        self.ids = letters(llm, "abcdefabcdef")

    def propose(self, req: Request, max_len: int) -> list[int]:
        last = req.token_ids[-1]
        if last not in self.ids:
            return []
        i = self.ids.index(last) + 1
        return self.ids[i:i + max_len]


def chi2_two_sample(a: collections.Counter, b: collections.Counter) -> tuple[float, int]:
    """Chi-square statistic of two equal-size samples having one distribution, and its
    degrees of freedom."""
    cells = set(a) | set(b)
    return sum((a[k] - b[k]) ** 2 / (a[k] + b[k]) for k in cells), len(cells) - 1


def chi2_quantile_999(df: int) -> float:
    """Wilson-Hilferty approximation of the chi-square 0.999 quantile."""
    z, h = 3.090, 2.0 / (9 * df)
    return df * (1 - h + z * math.sqrt(h)) ** 3


def test_sampled_constrained_outputs_follow_plain_constrained_sampling(looping_model):
    """27 outcomes of (ab|cd|ef){3} at temperature 1.5; scripted drafts, 900 requests each
    way: the speculative outputs and plain masked sampling are one distribution."""
    n, regex = 900, r"(ab|cd|ef){3}"
    params = [SamplingParams(max_tokens=12, regex=regex, temperature=1.5, seed=i) for i in range(n)]
    kw = dict(model=looping_model, dtype="float32", max_total_tokens=16384)
    plain = collections.Counter(o.text for o in LLM(**kw).generate([PROMPT] * n, params))
    llm = LLM(**kw, **SPEC)
    llm.engine.speculator.proposer = ScriptedDrafts(llm)
    outs = llm.generate([PROMPT] * n, params)
    spec = collections.Counter(o.text for o in outs)
    assert all(re.fullmatch(regex, text) for text in spec)
    stat, df = chi2_two_sample(spec, plain)
    assert df == 26 and stat < chi2_quantile_999(df), (stat, spec, plain)
    s = llm.stats()
    assert s["spec_accepted_tokens"] > n and 0.2 < s["spec_acceptance_rate"] < 0.95, s
    assert_no_leak(s)
