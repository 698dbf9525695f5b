"""FP8 on CPU: pre-quantized checkpoints, on-the-fly quantization, the FP8 KV cache.

The FP8 GEMM runs through torch._scaled_mm, which PyTorch's CPU build implements, so these
tests exercise the same code path as the GPU. Tolerances:
- the loader is exact: every FP8 layer dequantizes bit-for-bit to the reference weights, and
  the FP8 model equals an fp32 model of the dequantized weights doing the same activation
  rounding (float32 summation-order noise only: 1e-4);
- FP8 vs full precision: e4m3 keeps 3 mantissa bits, so one rounding has a relative RMS error
  of ~2.5%; a GEMM rounding both operands ~3.5% (`test_fp8_gemm_error_is_fp8_rounding` checks
  < 5%). The tiny random demo model (init std 0.3) amplifies perturbations through its
  layers: we measured 9-14% relative L2 logit error, and allow 20%;
- FP8 KV cache: only K and V are rounded (one rounding each, ~2.5%), but the same random
  model amplifies it: we measured 12.5% relative L2 logit error and 82% top-1 agreement
  (teacher-forced prefill + 4 decode steps) and allow 20% / 70%.
"""
from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import torch
from fp8_checkpoints import write_fp8_checkpoints, set_quantization_config
from safetensors.torch import load_file, save_file
from test_models import MiniRunner, random_sequences
from triton_on_cpu import compile_for_sm90, run_under_interpreter

from engine.attention.kv_pool import KVPool
from engine.layers.linear import LinearBase
from engine.models import load_model
from engine.quantization.fp8 import FP8, dequantize, fp8_linear, quantize_rows


FORMATS = ["ct-tensor", "ct-channel", "ct-channel-weight-only", "fp8-block"]


@pytest.fixture(scope="module")
def checkpoints(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return lambda fmt: write_fp8_checkpoints(tiny_llama, root, fmt)


def _linears(model) -> list[LinearBase]:
    return [m for m in model.modules() if isinstance(m, LinearBase)]


def _fake_quant_inputs(model) -> None:
    """Round every linear layer's input as the FP8 GEMM does (per token), in float32."""
    def hook(_module, args):
        x = args[0]
        x_q, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
        return ((x_q.float() * scale).view(x.shape),)
    for layer in _linears(model):
        layer.register_forward_pre_hook(hook)


def dequantize_fp8_(model, round_scaled_mm_inputs: bool = False) -> None:
    """Every float8 weight of `model` (linears and MoE experts) back to float32, scales
    dropped: the reference an FP8 model must equal. With `round_scaled_mm_inputs`, the
    linears `_scaled_mm` would multiply round their inputs per token as it takes them (CPU
    and prefill-sized batches: W8A8); the experts read unrounded activations (W8A16)."""
    from torch import nn

    from engine.layers.moe import FusedMoE
    from engine.quantization.fp8 import scaled_mm_ok

    def round_input(_module, args):
        x = args[0]
        x_q, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
        return ((x_q.float() * scale).view(x.shape),)

    for layer in _linears(model):
        if layer.weight_scale is not None:
            if round_scaled_mm_inputs and scaled_mm_ok(layer.weight, layer.weight_scale):
                layer.register_forward_pre_hook(round_input)
            layer.weight = nn.Parameter(dequantize(layer.weight, layer.weight_scale, torch.float32),
                                        requires_grad=False)
            layer.weight_scale = None
    for experts in (m for m in model.modules() if isinstance(m, FusedMoE)):
        if experts.w13_scale is not None:
            for name in ("w13", "w2"):
                w, scale = getattr(experts, name), getattr(experts, f"{name}_scale")
                setattr(experts, name, nn.Parameter(w.float() * scale, requires_grad=False))
                setattr(experts, f"{name}_scale", None)


def _greedy(model, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy continuations of all prompts in one batch, and every step's logits."""
    runner = MiniRunner(model)
    model.set_attention_backend(runner.backend)
    out = runner.step(dict(enumerate(prompts)))
    tokens, logits = [[] for _ in prompts], []
    for _ in range(steps):
        last = torch.stack([out[r][-1] for r in range(len(prompts))])
        logits.append(last)
        for r, t in enumerate(last.argmax(-1).tolist()):
            tokens[r].append(t)
        out = runner.step({r: [tokens[r][-1]] for r in range(len(prompts))})
    return tokens, logits


def _prompt_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    """Logits of every prompt position, all prompts concatenated."""
    runner = MiniRunner(model)
    model.set_attention_backend(runner.backend)
    out = runner.step(dict(enumerate(prompts)))
    return torch.cat([out[r] for r in range(len(prompts))])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_fp8_gemm_error_is_fp8_rounding():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 256, generator=gen), torch.randn(128, 256, generator=gen)
    w_q, w_scale = quantize_rows(w)
    assert w_q.dtype == FP8 and w_scale.shape == (128, 1)
    y = fp8_linear(x, w_q, w_scale, None)
    assert _rel(y, x @ w.t()) < 0.05
    # The GEMM equals the dequantize-and-matmul math exactly up to float32 summation order.
    x_q, x_scale = quantize_rows(x)
    ref = (x_q.float() * x_scale) @ dequantize(w_q, w_scale, torch.float32).t()
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_checkpoint_loads_exactly_and_matches_dequantized_greedy(checkpoints, fmt):
    fp8_dir, deq_dir = checkpoints(fmt)
    model = load_model(fp8_dir, dtype="float32", device="cpu")
    ref = load_model(deq_dir, dtype="float32", device="cpu")
    for ours, theirs in zip(_linears(model), _linears(ref), strict=True):
        assert ours.weight.dtype == FP8 and theirs.weight_scale is None
        assert torch.equal(dequantize(ours.weight, ours.weight_scale, torch.float32), theirs.weight)
    # Dynamic per-token activations (per-tensor / per-channel weights) round the layers'
    # inputs; weight-only and block-scaled layers compute in float32 like the reference.
    if fmt in ("ct-tensor", "ct-channel"):
        _fake_quant_inputs(ref)
    prompts = random_sequences(model.config.vocab_size, [6, 11, 3], seed=1)
    tokens, logits = _greedy(model, prompts, steps=6)
    ref_tokens, ref_logits = _greedy(ref, prompts, steps=6)
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_on_the_fly_fp8_stays_close_and_generates(tiny_llama):
    from engine.runtime.llm import LLM
    from engine.core.sampling_params import SamplingParams

    model = load_model(tiny_llama, dtype="float32", device="cpu", quantization="fp8")
    ref = load_model(tiny_llama, dtype="float32", device="cpu")
    assert all(m.weight.dtype == FP8 and m.weight_scale.shape[1] == 1 for m in _linears(model))
    prompts = random_sequences(model.config.vocab_size, [9, 14], seed=2)
    logits, ref_logits = _prompt_logits(model, prompts), _prompt_logits(ref, prompts)
    error = _rel(logits, ref_logits)
    top1 = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    print(f"on-the-fly fp8: relative logit error {error:.3f}, top-1 agreement {top1:.2f}")
    assert error < 0.35 and top1 > 0.6
    # And it is exactly the FP8 math: the reference with its weights and inputs rounded.
    for layer in _linears(ref):
        w_q, w_scale = quantize_rows(layer.weight.data)
        layer.weight.data = dequantize(w_q, w_scale, torch.float32)
    _fake_quant_inputs(ref)
    torch.testing.assert_close(logits, _prompt_logits(ref, prompts), atol=1e-4, rtol=1e-4)

    llm = LLM(model=tiny_llama, quantization="fp8", max_total_tokens=256, enable_radix_cache=False)
    try:
        out = llm.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    finally:
        llm.close()
    assert len(out[0].token_ids) == 8


@pytest.mark.parametrize("qc,message", [
    ({"quant_method": "awq", "bits": 4}, "'awq'"),
    ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}}, "pack-quantized"),
])
def test_unsupported_quantization_configs_are_errors(checkpoints, tmp_path, qc, message):
    fp8_dir, _ = checkpoints("ct-channel")
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(fp8_dir, bad)
    set_quantization_config(bad, qc)
    with pytest.raises(ValueError, match=message):
        load_model(str(bad), dtype="float32", device="cpu")


def test_float8_without_scales_is_an_error(checkpoints, tmp_path):
    import shutil
    fp8_dir, _ = checkpoints("ct-channel")
    no_config = tmp_path / "no-config"
    shutil.copytree(fp8_dir, no_config)
    set_quantization_config(no_config, None)  # float8 tensors, nothing saying how they scale
    with pytest.raises(ValueError, match="config.json has no quantization_config"):
        load_model(str(no_config), dtype="float32", device="cpu")

    no_scale = tmp_path / "no-scale"
    shutil.copytree(fp8_dir, no_scale)
    tensors = load_file(str(no_scale / "model.safetensors"))
    del tensors["model.layers.0.self_attn.q_proj.weight_scale"]
    save_file(tensors, str(no_scale / "model.safetensors"))
    with pytest.raises(ValueError, match="q_proj.weight' has no weight_scale"):
        load_model(str(no_scale), dtype="float32", device="cpu")


def test_unquantized_layer_in_fp8_checkpoint_is_an_error(checkpoints, tiny_llama, tmp_path):
    import shutil
    fp8_dir, _ = checkpoints("ct-channel")
    mixed = tmp_path / "mixed"
    shutil.copytree(fp8_dir, mixed)
    tensors = load_file(str(mixed / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight"] = load_file(
        str(Path(tiny_llama) / "model.safetensors"))["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(mixed / "model.safetensors"))
    with pytest.raises(ValueError, match="unquantized"):
        load_model(str(mixed), dtype="float32", device="cpu")


def _forced_logits(model, prompts, continuations, kv_dtype) -> torch.Tensor:
    """Prefill + decode steps feeding the given tokens: every new position's logits."""
    runner = MiniRunner(model)
    runner.pool.__init__(512, model.num_layers, model.num_kv_heads, model.head_dim, kv_dtype, "cpu")
    out = [runner.step(dict(enumerate(prompts)))]
    for i in range(len(continuations[0])):
        out.append(runner.step({r: [c[i]] for r, c in enumerate(continuations)}))
    return torch.cat([step[r] for step in out for r in range(len(prompts))])


def test_fp8_kv_cache_close_to_full_precision(tiny_llama):
    model = load_model(tiny_llama, dtype="float32", device="cpu")
    prompts = random_sequences(model.config.vocab_size, [12, 5, 20], seed=3)
    continuations, _ = _greedy(model, prompts, steps=4)
    ref = _forced_logits(model, prompts, continuations, torch.float32)
    ours = _forced_logits(model, prompts, continuations, FP8)
    error = _rel(ours, ref)
    top1 = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"fp8 KV cache: relative logit error {error:.4f}, top-1 agreement {top1:.2f}")
    assert 0 < error < 0.2 and top1 > 0.7  # > 0: the cache really was rounded


def test_fp8_kv_pool_holds_more_tokens_per_byte():
    shape = (4, 2, 64)  # layers, kv heads, head dim
    fp8, bf16, fp32 = (KVPool.bytes_per_token(*shape, dt) for dt in (FP8, torch.bfloat16, torch.float32))
    assert bf16 == 2 * fp8 and fp32 == 4 * fp8
    budget = 1 << 20
    pools = {dt: KVPool(budget // KVPool.bytes_per_token(*shape, dt), *shape, dt, "cpu")
             for dt in (FP8, torch.bfloat16)}
    assert pools[FP8].num_slots == 2 * pools[torch.bfloat16].num_slots
    for pool in pools.values():  # and the tensors really take what the sizing assumed
        used = sum(t.numel() * t.element_size() for t in pool.k + pool.v)
        assert used == (pool.num_slots + 1) * KVPool.bytes_per_token(*shape, pool.dtype)


def test_runner_builds_fp8_kv_pool(tiny_llama):
    from engine.config import EngineConfig
    from engine.executor.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(model=tiny_llama, device="cpu", kv_cache_dtype="fp8_e4m3",
                                      max_total_tokens=64), load_model=load_model)
    assert runner.kv_pool.k[0].dtype == FP8 and runner.kv_pool.fp8
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int4")


def test_block_scaled_weights_take_the_weight_only_kernel_when_it_can_step_their_groups():
    """Which FP8 weights decode through the weight-only GEMV (GPU, <= 16 rows): per-channel
    scales, and block scales whose K-width is a power of two of at least 16 (checkpoints'
    128); other widths dequantize (fp8_linear's slow path), as every block scale did before."""
    from engine.kernels.gemv import fit_scale_groups, scale_group
    from engine.kernels.tiles import Tiles

    k = 4096
    assert scale_group(k, None) == 0 and scale_group(k, torch.ones(8, 1)) == 0
    assert scale_group(k, torch.ones(8, k // 128)) == 128
    assert scale_group(3 * 96, torch.ones(8, 3)) == -1  # 96 wide: not a power of two
    assert scale_group(k, torch.ones(8, k // 8)) == -1  # too narrow for a K step
    assert fit_scale_groups(Tiles(32, 512), k, torch.ones(8, k // 128)).block_k == 128
    assert fit_scale_groups(Tiles(32, 64), k, torch.ones(8, k // 128)).block_k == 64


@pytest.mark.parametrize("fast", [True, False])
def test_fast_accumulation_setting_reaches_scaled_mm(tiny_llama, monkeypatch, fast):
    """`EngineConfig.fp8_fast_accum` (default True) is what every FP8 layer's
    `torch._scaled_mm` gets as use_fast_accum (the GPU test measures what it changes)."""
    from engine.config import EngineConfig
    from engine.executor.model_runner import ModelRunner

    assert EngineConfig().fp8_fast_accum is True
    calls = []
    real = torch._scaled_mm

    def recording(*args, **kwargs):
        calls.append(kwargs.get("use_fast_accum"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    runner = ModelRunner(EngineConfig(model=tiny_llama, device="cpu", quantization="fp8",
                                      fp8_fast_accum=fast, max_total_tokens=64), load_model=load_model)
    layers = [m for m in runner.model.modules() if isinstance(m, LinearBase)]
    assert layers and all(m.fast_accum is fast for m in layers)
    layer = layers[0]
    layer(torch.randn(20, layer.weight.shape[1]))  # 20 rows: above decode sizes, _scaled_mm
    assert calls == [fast]


# ---- the GPU kernels, on the CPU --------------------------------------------------------------

def test_fp8_weight_kernels_under_the_interpreter():
    """tests/test_fp8_kernels.py (GPU tests) on the CPU through TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    run_under_interpreter("test_fp8_kernels.py", allow_skipped=True)  # GPU-only cases skip


def test_fp8_weight_kernels_compile_for_hopper():
    """Every variant the GPU path launches compiles for sm_90, and the activations' cast to
    float8 is the hardware's saturating round-to-nearest (the interpreter's is not exact)."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend")
    from engine.kernels.gemv import _gemv_kernel, _sum_splits_kernel
    from engine.kernels.fp8 import _quantize_rows_kernel

    gemv = dict(X="*bf16", W="*fp8e4nv", Scale="*fp32", Out="*bf16", M="i32", N="i32", K="i32",
                k_per_split="i32", row_scale="fp32")
    for block_m, split_k in itertools.product((1, 16, 32), (1, 4)):
        compile_for_sm90(_gemv_kernel, {**gemv, "Out": "*fp32" if split_k > 1 else "*bf16"},
                         dict(PRECISION="tf32", BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=256, SPLIT_K=split_k),
                         num_stages=4)
    for block_m, row_dot in ((1, False), (1, True), (16, False)):  # block-scaled weights
        compile_for_sm90(_gemv_kernel, {**gemv, "Out": "*fp32"},
                         dict(PRECISION="tf32", BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128,
                              SPLIT_K=4, ROW_DOT=row_dot, SCALE_GROUP=128), num_stages=4)
    for split_k in (1, 4):  # one row on the tensor cores (`Tiles.row_dot`)
        ptx = compile_for_sm90(_gemv_kernel, {**gemv, "Out": "*fp32" if split_k > 1 else "*bf16"},
                               dict(PRECISION="tf32", BLOCK_M=1, BLOCK_N=64, BLOCK_K=128,
                                    SPLIT_K=split_k, ROW_DOT=True), num_stages=4)
        # the activations are scaled in float32, then cast to f16: an f16 multiply would
        # mean the cast came first, and activations past 65,504 would overflow
        assert "mul.f32" in ptx and not re.search(r"mul(\.rn)?\.f16", ptx)
    compile_for_sm90(_sum_splits_kernel, dict(Partial="*fp32", Out="*bf16", size="i32"),
                     dict(SPLIT_K=4, BLOCK=1024))
    ptx = compile_for_sm90(_quantize_rows_kernel, dict(X="*bf16", Q="*fp8e4nv", Scale="*fp32", K="i32",
                                                       fp8_max="fp32", min_scale="fp32"),
                           dict(BLOCK_K=2048))
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert "div.rn.f32" in ptx  # IEEE division, as the torch expression


def test_fused_kernels_hand_fp8_linears_quantized_inputs_only_where_they_alone_read(tiny_llama):
    """`set_fused_kernels` on an FP8 model wires each norm / SiLU-and-mul to the one FP8
    linear that reads its output; a bf16 model gets none (MoE models: tests/test_moe.py)."""
    from engine.layers import set_fused_kernels

    model = load_model(tiny_llama, dtype="float32", quantization="fp8")
    set_fused_kernels(model, True)
    for layer in model.model.layers:
        for producer in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp.act_fn):
            assert producer.quantizes_for(17) and not producer.quantizes_for(16)
    assert model.model.norm.quantizes_for is None  # the LM head is not FP8
    set_fused_kernels(model, False)
    assert model.model.layers[0].input_layernorm.quantizes_for is None
    dense = load_model(tiny_llama, dtype="float32")
    set_fused_kernels(dense, True)
    assert all(m.quantizes_for is None for m in dense.modules() if hasattr(m, "quantizes_for"))
