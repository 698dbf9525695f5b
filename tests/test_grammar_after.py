"""SamplingParams.grammar_after: the constraint starts once the output has written a marker
("</think>"), through the engine's own `Grammars` (xgrammar, the demo tokenizer): free
before it, the grammar's masks and termination after it, rollback across it."""
from __future__ import annotations

import json

import pytest
import torch

from engine.loading.demo_model import ensure_demo_model
from engine.grammar import Grammars
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.loading.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(ensure_demo_model())


@pytest.fixture(scope="module")
def grammars(tok) -> Grammars:
    return Grammars("xgrammar", tok.hf, tok.vocab_size, tok.eos_token_ids, torch.device("cpu"))


def _request(grammars, **params) -> Request:
    p = SamplingParams(json_schema=SCHEMA, max_tokens=64, **params)
    return Request("r", [1, 2, 3], p, grammar=grammars.submit(p))


def _allowed(grammars, req) -> torch.Tensor:
    masks, failed = grammars.token_masks([req])
    assert not failed
    return masks[0]


def test_free_until_the_marker_then_the_grammar(tok, grammars):
    req = _request(grammars, grammar_after="</think>")
    thinking = tok.encode("Let me think: no JSON here!\n</think>")[1:]
    for t in thinking:
        assert _allowed(grammars, req).all()  # reasoning: every token allowed
        assert grammars.jump_forward(req, t, 8) == [] and not grammars.is_terminated(req)
        assert grammars.accept(req, t)
    # The marker is out: from here the schema holds, exactly as without grammar_after.
    plain = _request(grammars)
    assert torch.equal(_allowed(grammars, req), _allowed(grammars, plain))
    newline = tok.encode("\n")[-1]
    assert not _allowed(grammars, req)[newline]
    answer = tok.encode('{"ok": true}')[1:] + sorted(tok.eos_token_ids)[:1]
    for t in answer:
        assert _allowed(grammars, req)[t]
        assert grammars.accept(req, t)
    assert grammars.is_terminated(req)
    json.loads(tok.decode(answer))


def test_a_refused_token_after_the_marker_is_refused(tok, grammars):
    req = _request(grammars, grammar_after="</think>")
    for t in tok.encode("x</think>")[1:]:
        assert grammars.accept(req, t)
    assert not grammars.accept(req, tok.encode("hello")[-1])


def test_rollback_back_across_the_marker(tok, grammars):
    req = _request(grammars, grammar_after="</think>")
    thinking = tok.encode("ab</think>")[1:]  # the marker ends in the last of these
    answer = tok.encode('{"ok"')[1:]
    for t in thinking + answer:
        assert grammars.accept(req, t)
    grammars.matcher_of(req).rollback(len(answer) + 1)  # before the marker's end: free again
    assert _allowed(grammars, req).all()
    assert grammars.accept(req, thinking[-1])
    assert not _allowed(grammars, req).all()  # the marker again: constrained again
    for t in answer:
        assert grammars.accept(req, t)


def test_grammar_after_needs_a_constraint():
    with pytest.raises(ValueError, match="grammar_after"):
        SamplingParams(grammar_after="</think>")
    with pytest.raises(ValueError, match="grammar_after"):
        SamplingParams(json_object=True, grammar_after="")
