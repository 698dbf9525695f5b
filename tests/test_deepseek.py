"""DeepSeek-V2 / V3 (tiny random weights, built here with transformers): multi-head latent
attention over the latent KV pool, shared experts and grouped top-k routing.

- The models (tests/deepseek_models.py): V2 in V2-Lite's shape (no query LoRA) with
  group-limited softmax routing and YaRN; V3 with query LoRA and biased sigmoid routing.
- Greedy tokens and logprobs equal transformers' in float32 at TP 1 and TP 2 (gloo; V3 with
  its experts split whole, EP); with chunked prefill and n-gram speculation too.
- The pool keeps one latent + RoPE key per token and layer (bytes as the config implies);
  a prompt whose prefix the radix cache holds gives the cold engine's outputs.
- The Triton decode kernel against torch, and an engine decoding through it against the
  torch backend, under Triton's interpreter (tests/test_mla_decode.py); on a GPU the engine
  (CUDA graphs) against the CPU engine.
"""
from __future__ import annotations

import json
import random

import pytest
import torch
from deepseek_models import COMMON, deepseek_v2_dir, deepseek_v3_dir
from hf_reference import hf_greedy_logprobs

from engine import LLM, SamplingParams

NEW_TOKENS = 12  # enough for the outputs to repeat themselves: n-gram drafts in both models


@pytest.fixture(scope="module")
def v2_dir(tmp_path_factory, tiny_llama) -> str:
    return deepseek_v2_dir(tmp_path_factory.mktemp("deepseek_v2"), tiny_llama)


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory, tiny_llama) -> str:
    return deepseek_v3_dir(tmp_path_factory.mktemp("deepseek_v3"), tiny_llama)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = random.Random(7)
    shared = [gen.randint(3, 700) for _ in range(40)]
    return [shared + [gen.randint(3, 700) for _ in range(n)] for n in (5, 23)]


def check_against_transformers(llm: LLM, model_dir: str, prompts: list[list[int]]) -> list:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
    outs = [llm.generate([p], params)[0] for p in prompts]  # in turn: the second hits the cache
    for prompt, out in zip(prompts, outs):
        tokens, logprobs = hf_greedy_logprobs(model_dir, prompt, NEW_TOKENS)
        assert out.token_ids == tokens
        assert out.logprobs == pytest.approx(logprobs, abs=1e-4)
    return outs


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_greedy_tokens_and_logprobs_equal_transformers(request, version, prompts):
    """Radix cache, chunked prefill in 16-token chunks and n-gram speculation: the second
    prompt reuses the first's cached latents and prefills the rest chunk by chunk over them;
    outputs that repeat themselves get n-gram drafts verified over the pool (multi-token
    extends, rejected drafts rolled back). Then a JSON schema through the same engine."""
    model_dir = request.getfixturevalue(f"{version}_dir")
    llm = LLM(model=model_dir, dtype="float32", max_total_tokens=1024, chunked_prefill_size=16,
              speculative_algorithm="ngram", speculative_num_draft_tokens=4)
    outs = check_against_transformers(llm, model_dir, prompts + [[5, 6, 7, 8, 9] * 8])
    assert outs[1].cached_tokens >= 32, outs[1].cached_tokens
    assert sum(o.speculative["spec_drafted_tokens"] for o in outs) > 0
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    text = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=24, temperature=0.0,
                                                    json_schema=schema))[0].text
    assert set(json.loads(text)) == {"n"}


@pytest.mark.parametrize("version,moe_parallel", [pytest.param("v2", "tp", marks=pytest.mark.slow),
                                                  ("v3", "ep")])
def test_tp2_equals_transformers(request, version, moe_parallel, prompts):
    model_dir = request.getfixturevalue(f"{version}_dir")
    llm = LLM(model=model_dir, dtype="float32", max_total_tokens=1024, tp_size=2,
              moe_parallel=moe_parallel, chunked_prefill_size=0)
    check_against_transformers(llm, model_dir, prompts)


def test_latent_pool_bytes_and_cached_prefix_equal_cold(v3_dir, prompts):
    """The pool's rows are latent + RoPE key (no per-head K/V); a prompt served over its
    cached prefix, on the device or brought back from the host tier, gives exactly the
    outputs of an engine without the cache."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
    common = dict(model=v3_dir, dtype="float32", chunked_prefill_size=0)
    cold_llm = LLM(max_total_tokens=512, enable_radix_cache=False, **common)
    cold = cold_llm.generate([prompts[1]], params)[0]
    assert cold.cached_tokens == 0
    warm = LLM(max_total_tokens=512, **common)
    pool = warm.engine.runner.kv_pool
    layers, width = COMMON["num_hidden_layers"], COMMON["kv_lora_rank"] + COMMON["qk_rope_head_dim"]
    assert pool.token_bytes == layers * width * 4  # float32
    per_head_kv = layers * COMMON["num_attention_heads"] * 2 * 32 * 4  # K and V, 32 wide
    assert pool.token_bytes * 4 < per_head_kv
    assert pool.k[0].shape == (513, 1, width) and pool.v[0].numel() == 0
    # 80 device slots: the filler prompt pushes the first prompt's prefix out to the host.
    tiered = LLM(max_total_tokens=80, host_kv_cache_gb=0.001, **common)
    for llm in (warm, tiered):
        llm.generate([prompts[0]], params)
        if llm is tiered:
            llm.generate([[9, 10, 11] * 20], params)
        hot = llm.generate([prompts[1]], params)[0]
        assert hot.cached_tokens >= 32
        assert hot.token_ids == cold.token_ids
        assert hot.logprobs == pytest.approx(cold.logprobs, abs=1e-5)
    assert tiered.stats()["host_cached_tokens"] >= 32
    # Another replica imports the latents (as a fetch from a peer does) and serves them alike.
    exported = tiered.engine.export_prefix(prompts[1])
    peer = LLM(max_total_tokens=512, host_kv_cache_gb=0.001, **common)
    assert peer.engine.import_prefix(exported) == len(exported.tokens) >= 32
    fetched = peer.generate([prompts[1]], params)[0]
    assert fetched.cached_tokens == min(len(exported.tokens), len(prompts[1]) - 1)
    assert fetched.token_ids == cold.token_ids
    assert fetched.logprobs == pytest.approx(cold.logprobs, abs=1e-5)


def test_mla_decode_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    from triton_on_cpu import run_under_interpreter

    run_under_interpreter("test_mla_decode.py", allow_skipped=True)  # (bf16: GPU only)


def test_mla_decode_kernel_compiles_for_hopper():
    """At DeepSeek-V2/V3's widths (latent 512, RoPE key 64) in bf16 and over an FP8 pool."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend")
    from triton_on_cpu import compile_for_sm90

    from engine.kernels.attention.decode import decode_reduce_kernel
    from engine.kernels.attention.mla_decode import MAX_SPLITS, _mla_decode_kernel

    for cache, fp8 in (("*bf16", False), ("*fp8e4nv", True)):
        types = dict(QLat="*bf16", QRope="*bf16", Cache=cache, SeqLens="*i32", Out="*fp32",
                     Lse="*fp32", scale_log2="fp32", kv_scale="fp32")
        compile_for_sm90(_mla_decode_kernel, types, dict(C=512, R=64, BLOCK_H=16, BLOCK_N=32,
                                                         F32_DOT=False, KV_FP8=fp8),
                         num_warps=4, num_stages=2)
    types = dict(MidO="*fp32", MidLse="*fp32", SeqLens="*i32", Out="*bf16", PfxLens="*i32",
                 PfxO="*bf16", PfxLse="*bf16", Ctrl="*i32", QoIndptr="*i32", ExtendLens="*i32")
    compile_for_sm90(decode_reduce_kernel, types, dict(BLOCK_N=32, HEAD_DIM=512, BLOCK_D=512,
                                                       BLOCK_S=MAX_SPLITS), num_warps=4)


@pytest.mark.gpu
@pytest.mark.parametrize("version", ["v2", "v3"])
def test_gpu_greedy_equals_cpu(request, version, prompts):
    """The Triton decode kernel in CUDA graphs, the fused norms and RoPE, the MoE kernels."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model_dir = request.getfixturevalue(f"{version}_dir")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    cpu = LLM(model=model_dir, device="cpu", dtype="float32", max_total_tokens=1024)
    gpu = LLM(model=model_dir, device="cuda", dtype="float32", max_total_tokens=1024)
    assert ([o.token_ids for o in gpu.generate(prompts, params)]
            == [o.token_ids for o in cpu.generate(prompts, params)])


def test_kv_bytes_benchmark_reads_the_latent_pool(tmp_path):
    """scripts/bench_mla.py --rows kv sizes the DeepSeek-V2-Lite-shaped pool's rows from the
    engine's own pool: one 576-wide latent (512 + 64 RoPE dims) per token and layer, 27
    layers in bf16, against 16 heads of K and V at 192 / 128 dims."""
    from bench_scripts import run_script

    kv = run_script("bench_mla.py", "--rows", "kv", json_path=tmp_path / "mla.json")[0]["kv"]
    assert kv["mla_bytes_per_token"] == 27 * 576 * 2
    assert kv["tokens"] == 64 * 4096
    assert kv["mla_over_gqa8"] == pytest.approx(576 / (2 * 8 * 128))
    assert kv["mha_gb_per_step"] == pytest.approx(27 * 16 * (192 + 128) * 2 * kv["tokens"] / 1e9)
