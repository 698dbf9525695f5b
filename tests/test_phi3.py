"""Phi-3 (tiny random weights, built here with transformers): LongRoPE with its short and
long factors, partial rotary (Phi-4-mini's 3/4 of each head) and the checkpoint's fused
qkv_proj / gate_up_proj. Greedy tokens and logprobs equal transformers' in float32 at TP 1
and TP 2 (gloo), for a prompt within the pretraining context and one past it (the short and
the long factors). A request whose decoding crosses the pretraining context is left out:
transformers then recomputes the whole sequence with the long factors (its Phi-3
`prepare_inputs_for_generation` drops the cache), which the engine does not do
(engine/layers/longrope.py)."""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from hf_reference import hf_greedy_logprobs, save_tiny_hf_model, vocab_size_of

ORIGINAL_CONTEXT = 64
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory, tiny_llama) -> str:
    from transformers import Phi3Config

    half_rotary = int(16 * 0.75) // 2  # head_dim 16
    gen = random.Random(3)
    config = Phi3Config(
        vocab_size=vocab_size_of(tiny_llama), hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4 * ORIGINAL_CONTEXT,
        original_max_position_embeddings=ORIGINAL_CONTEXT, partial_rotary_factor=0.75,
        rope_scaling={"rope_type": "longrope",
                      "short_factor": [gen.uniform(1.0, 1.5) for _ in range(half_rotary)],
                      "long_factor": [gen.uniform(2.0, 8.0) for _ in range(half_rotary)]},
        initializer_range=0.2, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    return save_tiny_hf_model(config, tmp_path_factory.mktemp("phi3"), tiny_llama)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = random.Random(5)
    return [[gen.randint(3, 700) for _ in range(n)]
            for n in (20, ORIGINAL_CONTEXT + 16)]


@pytest.mark.parametrize("tp_size", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_greedy_tokens_and_logprobs_equal_transformers(phi3_dir, prompts, tp_size):
    llm = LLM(model=phi3_dir, dtype="float32", max_total_tokens=1024, tp_size=tp_size,
              chunked_prefill_size=0)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                ignore_eos=True, logprobs=True))
    for prompt, out in zip(prompts, outs):
        tokens, logprobs = hf_greedy_logprobs(phi3_dir, prompt, NEW_TOKENS)
        assert out.token_ids == tokens
        assert out.logprobs == pytest.approx(logprobs, abs=1e-4)


def test_long_factors_differ_from_short(phi3_dir):
    """The two sets give different rotations (else the length rule would be untested)."""
    from engine.models import load_model

    rope = load_model(phi3_dir, dtype="float32", device="cpu").model.longrope
    assert rope is not None and rope.rotary_dim == 12
    short = rope.cos_sin_cache[ORIGINAL_CONTEXT - 1]
    long = rope.cos_sin_cache[rope.max_position + ORIGINAL_CONTEXT - 1]
    assert not torch.allclose(short, long, atol=1e-3)


@pytest.mark.gpu
def test_gpu_greedy_equals_cpu(phi3_dir, prompts):
    """LongRoPE's two-set cache through the fused RoPE path and CUDA graphs."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    cpu = LLM(model=phi3_dir, device="cpu", dtype="float32", max_total_tokens=1024)
    gpu = LLM(model=phi3_dir, device="cuda", dtype="float32", max_total_tokens=1024)
    assert ([o.token_ids for o in gpu.generate(prompts, params)]
            == [o.token_ids for o in cpu.generate(prompts, params)])
