"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against HF transformers, at tp 1
and at tp 2 with experts sharded ("tp") or split whole ("ep"); the routing and the expert
computation on their own; the Triton path under Triton's interpreter."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.layers.moe import FusedMoE, experts_torch
from engine.kernels.moe.router import select_experts
from engine.kernels.moe.routing import group_by_expert, max_blocks
from engine.layers.parallel import TPContext
from engine.models import load_model
from hf_reference import hf_greedy
from moe_models import MOE_ARCHS, moe_factory  # noqa: F401 (a fixture)
from triton_on_cpu import compile_for_sm90, run_under_interpreter
from test_models import MiniRunner, assert_close, assert_ranks_match_single, hf_logits, random_sequences

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def prompts_for(vocab: int) -> list[list[int]]:
    return random_sequences(vocab, [5, 12, 3], seed=11)  # the demo tokenizer's vocab: 768


def test_norm_before_the_router_is_no_quantized_input(moe_factory):
    """An MoE layer's post-attention norm feeds the router (kept in the model dtype) and the
    experts (W8A16: activations unquantized), so it is never paired with one FP8 linear to
    quantize for (`set_fused_kernels`); the norm before qkv and the shared expert's
    SiLU-and-mul are."""
    from engine.models.moe import SparseMoeBlock

    model = load_model(moe_factory("qwen2_moe"), dtype="float32", quantization="fp8")
    sparse = [layer for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert sparse
    for layer in sparse:
        attn, shared = layer.self_attn, layer.mlp.shared_expert
        assert layer.quantized_input_pairs() == [(layer.input_layernorm, attn.qkv_proj)]
        assert shared.quantized_input_pairs() == [(shared.act_fn, shared.down_proj)]


# ---- FP8 weights ---------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_fp8_moe_is_its_dequantized_model(moe_factory, arch):
    """quantization="fp8" on an MoE model: the linear layers but the routers, and the stacked
    experts, become float8 with one scale per output row. Its logits equal those of the same
    model with every float8 weight dequantized, the FP8 linears' inputs rounded per token as
    `_scaled_mm` takes them (the experts read unrounded activations: W8A16), and stay close
    to the unquantized model's."""
    from engine.models.moe import SparseMoeBlock
    from engine.quantization.fp8 import FP8
    from test_fp8 import _prompt_logits, _rel, dequantize_fp8_

    path = moe_factory(arch)
    model = load_model(path, dtype="float32", quantization="fp8")
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(b.gate.weight.dtype == torch.float32 for b in blocks)  # routers kept
    assert all(b.experts.w13.dtype == FP8 and b.experts.w2.dtype == FP8 for b in blocks)
    assert all(b.experts.w13_scale.shape == (*b.experts.w13.shape[:2], 1) for b in blocks)

    ref = load_model(path, dtype="float32", quantization="fp8")
    dequantize_fp8_(ref, round_scaled_mm_inputs=True)
    prompts = random_sequences(model.config.vocab_size, [9, 14], seed=3)
    logits = _prompt_logits(model, prompts)
    torch.testing.assert_close(logits, _prompt_logits(ref, prompts), atol=1e-4, rtol=1e-4)
    full = _prompt_logits(load_model(path, dtype="float32"), prompts)
    # Measured on a CPU: Mixtral 0.45, Qwen2-MoE 0.38, Qwen3-MoE 0.24. Larger than a
    # dense tiny model's 0.09-0.14 (test_fp8.py): rounding flips some tokens' expert choices.
    # The equality above is the exact check; this one catches a scale gone wrong (x 2^k).
    assert _rel(logits, full) < 0.6


def test_fp8_moe_serves_and_refuses_prequantized_moe_checkpoints(moe_factory, tmp_path):
    """An FP8 MoE engine generates; an MoE checkpoint already in FP8 is refused at start-up
    (only bf16/fp32 MoE checkpoints quantized at load are supported), naming the way in."""
    import json
    import shutil

    path = moe_factory("qwen3_moe")
    llm = LLM(model=path, dtype="float32", quantization="fp8", max_total_tokens=512)
    try:
        out = llm.generate(prompts_for(768)[:2], GREEDY)
    finally:
        llm.close()
    assert all(len(o.token_ids) == 8 for o in out)
    fp8_dir = tmp_path / "fp8"
    shutil.copytree(path, fp8_dir)
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (fp8_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="pre-quantized FP8 checkpoints of MoE models"):
        load_model(str(fp8_dir), dtype="float32")


def test_fp8_experts_equal_dequantized_experts():
    """`experts_torch` with float8 weights and per-row scales equals the same experts with
    the weights dequantized (the CPU path and the reference of the Triton kernels)."""
    from engine.quantization.fp8 import quantize_rows

    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 32, generator=g)
    w13, w2 = torch.randn(4, 48, 32, generator=g), torch.randn(4, 32, 24, generator=g)
    weights, ids = select_experts(torch.randn(6, 4, generator=g), 2, renormalize=True)
    q13, s13 = quantize_rows(w13.reshape(-1, 32))
    q2, s2 = quantize_rows(w2.reshape(-1, 24))
    q13, s13, q2, s2 = q13.view(4, 48, 32), s13.view(4, 48, 1), q2.view(4, 32, 24), s2.view(4, 32, 1)
    out = experts_torch(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    ref = experts_torch(x, q13.float() * s13, q2.float() * s2, weights, ids)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    assert ((out - experts_torch(x, w13, w2, weights, ids)).norm() / out.norm()).item() < 0.1


# ---- whole models against HF ------------------------------------------------------------------

@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_logits_match_hf_prefill_decode_and_chunks(moe_factory, arch):
    path = moe_factory(arch)
    model = load_model(path, dtype="float32", device="cpu")
    seqs = random_sequences(model.config.vocab_size, [9, 14], seed=1)
    ref = hf_logits(path, seqs)
    runner = MiniRunner(model)
    first = runner.step({0: seqs[0][:6], 1: seqs[1][:4]})  # ragged prefill
    second = runner.step({0: seqs[0][6:7], 1: seqs[1][4:]})  # a decode beside a chunk
    third = runner.step({0: seqs[0][7:]})
    assert_close(torch.cat([first[0], second[0], third[0]]), ref[0])
    assert_close(torch.cat([first[1], second[1]]), ref[1])


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_outputs_equal_hf(moe_factory, arch):
    path = moe_factory(arch)
    llm = LLM(model=path, dtype="float32", max_total_tokens=1024)
    prompts = prompts_for(768)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, 8) for p in prompts]
    assert len({tuple(o.token_ids) for o in outs}) == len(prompts)  # not one degenerate output


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_yarn_logits_and_greedy_equal_hf_past_the_original_context(moe_factory, arch):
    path = moe_factory(arch, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                              "original_max_position_embeddings": 8})
    model = load_model(path, dtype="float32", device="cpu")
    seqs = random_sequences(model.config.vocab_size, [20], seed=3)
    runner = MiniRunner(model)
    first, rest = runner.step({0: seqs[0][:6]}), runner.step({0: seqs[0][6:]})
    assert_close(torch.cat([first[0], rest[0]]), hf_logits(path, seqs)[0])
    prompts = random_sequences(768, [5, 14], seed=4)  # decoding from inside to past 8
    outs = LLM(model=path, dtype="float32", max_total_tokens=1024).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, 8) for p in prompts]


# ---- tensor / expert parallelism ----------------------------------------------------------------

@pytest.mark.parametrize("arch,mode,tp_size", [(a, m, 2) for a in MOE_ARCHS for m in ("tp", "ep")]
                         + [("qwen3_moe", "ep", 4), ("qwen2_moe", "tp", 4)])
def test_parallel_logits_equal_tp1(moe_factory, arch, mode, tp_size):
    """Ranks as threads (collectives through shared memory): every rank's logits equal tp=1's."""
    path = moe_factory(arch)

    def load(tp: TPContext):
        model = load_model(path, dtype="float32", device="cpu", tp=tp, moe_parallel=mode)
        experts = model.model.layers[0].mlp.experts
        assert experts.num_local_experts == (8 // tp.size if mode == "ep" else 8)
        return model

    assert_ranks_match_single(tp_size, load)


@pytest.mark.parametrize("arch,mode", [("qwen2_moe", "ep"), ("qwen3_moe", "tp"), ("mixtral", "ep")])
def test_greedy_at_tp2_over_gloo_equals_hf(moe_factory, arch, mode):
    """Real rank processes joined by gloo, through the same machinery as dense TP."""
    path = moe_factory(arch)
    prompts = prompts_for(768)
    llm = LLM(model=path, dtype="float32", max_total_tokens=1024, tp_size=2, moe_parallel=mode)
    try:
        outs = llm.generate(prompts, GREEDY)
    finally:
        llm.close()
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, 8) for p in prompts]


def test_fp8_moe_at_tp2_stays_as_close_as_tp1(moe_factory):
    """FP8 experts and linears split over 2 gloo ranks, experts whole per rank (ep) or each
    expert's width split (tp): as close to the unquantized model as at tp 1 (the dense
    linears' row-parallel halves round their inputs with per-rank scales, as vLLM and SGLang
    do, so tp 2 is not bit-equal to tp 1; on this box: 0.059 at tp 1, 0.053 tp, 0.051 ep)."""
    path = moe_factory("qwen3_moe", std=0.1)
    prompts = prompts_for(768)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs_start=0)

    def logprobs(**kw) -> list[float]:
        llm = LLM(model=path, dtype="float32", max_total_tokens=1024, **kw)
        try:
            outs = llm.generate(prompts, params)
            return [x for o in outs for x in o.prompt_logprobs if x is not None]
        finally:
            llm.close()

    reference = logprobs()
    error = {}
    for tp, mode in ((1, "tp"), (2, "tp"), (2, "ep")):
        got = logprobs(quantization="fp8", tp_size=tp, moe_parallel=mode)
        diffs = [abs(a - b) for a, b in zip(got, reference, strict=True)]
        error[tp, mode] = sum(diffs) / len(diffs)
    print("FP8 MoE mean |logprob| difference from the unquantized model:", error)
    assert all(0 < e <= 1.5 * error[1, "tp"] + 0.01 for e in error.values()), error


def test_parallel_mode_errors():
    with pytest.raises(ValueError, match="moe_parallel"):
        EngineConfig(moe_parallel="dp")
    with pytest.raises(ValueError, match="number of experts 8 is not divisible by tensor parallel size 3"):
        FusedMoE(8, 16, 12, TPContext(0, 3), "ep")
    with pytest.raises(ValueError, match="MoE intermediate size 12 is not divisible"):
        FusedMoE(8, 16, 12, TPContext(0, 8), "tp")


# ---- routing and the expert computation ---------------------------------------------------------

@pytest.mark.parametrize("renormalize", [True, False])
def test_select_experts_matches_hf_routers(renormalize):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3,
                         norm_topk_prob=renormalize)
    router = Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(11, 16)
    _, hf_weights, hf_ids = router(x)
    weights, ids = select_experts(x @ router.weight.T, 3, renormalize)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights)
    assert torch.allclose(weights.sum(-1), torch.ones(11)) == renormalize


@pytest.mark.parametrize("num_tokens,top_k,first,block_m", [(1, 2, 0, 16), (37, 4, 4, 16),
                                                             (200, 8, 0, 64), (0, 2, 0, 16)])
def test_group_by_expert_blocks(num_tokens, top_k, first, block_m):
    """Every pair of a local expert sits once in a block of its expert, in token order; no
    other pair is anywhere; the block count depends on the token count alone."""
    num_experts, local = 16, 8 if first else 16
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)]) \
        if num_tokens else torch.zeros(0, top_k, dtype=torch.long)
    blocks = group_by_expert(ids, local, first, block_m)
    n_pairs = num_tokens * top_k
    assert blocks.block_expert.numel() == max_blocks(n_pairs, local, block_m)
    rows = blocks.sorted_pairs.view(-1, block_m)
    flat = ids.flatten()
    placed = []
    for b, expert in enumerate(blocks.block_expert.tolist()):
        pairs = [p for p in rows[b].tolist() if p < n_pairs]
        if expert < 0:
            assert pairs == []
            continue
        assert all(flat[p] == first + expert for p in pairs)
        placed += pairs
    wanted = [p for p in range(n_pairs) if first <= flat[p] < first + local]
    assert sorted(placed) == wanted and len(placed) == len(set(placed))
    assert placed == sorted(wanted, key=lambda p: int(flat[p]))  # stable: token order kept


def test_experts_torch_equals_every_expert_applied_densely():
    torch.manual_seed(0)
    t, e, k, h, i = 13, 6, 2, 16, 8
    x, w13, w2 = torch.randn(t, h), torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    weights, ids = select_experts(torch.randn(t, e), k, renormalize=False)
    dense = torch.zeros(t, e)
    dense.scatter_(1, ids, weights)  # each token's weight for every expert (0 if not chosen)
    gate_up = torch.einsum("th,eoh->teo", x, w13)
    act = torch.nn.functional.silu(gate_up[..., :i]) * gate_up[..., i:]
    expected = torch.einsum("tei,ehi,te->th", act, w2, dense)
    torch.testing.assert_close(experts_torch(x, w13, w2, weights, ids), expected,
                               atol=1e-4, rtol=1e-4)
    halves = sum(experts_torch(x, w13[s:s + 3], w2[s:s + 3], weights, ids, first_expert=s)
                 for s in (0, 3))
    torch.testing.assert_close(halves, expected, atol=1e-4, rtol=1e-4)


def test_triton_grouped_gemm_under_the_interpreter():
    """tests/test_moe_kernels.py (GPU tests) on the CPU through TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    run_under_interpreter("test_moe_kernels.py")


# ---- loading and unsupported options -------------------------------------------------------------

def test_missing_expert_weight_is_an_error(moe_factory, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = Path(moe_factory("mixtral"))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text((path / "config.json").read_text())
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if "layers.1.block_sparse_moe.experts.5.w3" not in k}
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.w13"):
        load_model(str(ckpt), device="cpu")
    # At tp=2 with EP, expert 5 is rank 1's: rank 0 loads without it.
    model = load_model(str(ckpt), device="cpu", tp=TPContext(0, 2), moe_parallel="ep")
    assert model.model.layers[1].mlp.experts.num_local_experts == 4


@pytest.mark.parametrize("arch,overrides", [
    ("mixtral", {"sliding_window": 6}),  # every layer
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 6}),  # layers 0 and 2 (layer_types)
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 6}),  # every layer
])
def test_sliding_window_logits_and_greedy_equal_hf(moe_factory, arch, overrides):
    path = moe_factory(arch, **overrides)
    model = load_model(path, dtype="float32", device="cpu")
    assert any(model.sliding_windows) and set(model.sliding_windows) <= {6, None}
    seqs = random_sequences(model.config.vocab_size, [16], seed=8)
    runner = MiniRunner(model)
    steps = [runner.step({0: seqs[0][:9]}), runner.step({0: seqs[0][9:10]}), runner.step({0: seqs[0][10:]})]
    assert_close(torch.cat([step[0] for step in steps]), hf_logits(path, seqs)[0])
    prompts = random_sequences(768, [4, 11], seed=9)
    outs = LLM(model=path, dtype="float32", max_total_tokens=1024).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, 8) for p in prompts]


def test_moe_kernels_compile_for_hopper():
    """The interpreter runs the kernels' Python, not Triton's compiler: every MoE kernel
    variant the GPU path launches compiles for sm_90 too."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend")
    from engine.kernels.moe.align import _count_kernel, _offsets_kernel, _scatter_kernel
    from engine.kernels.moe.grouped_gemm import _grouped_gemm_kernel, _sum_choices_kernel
    from engine.kernels.moe.grouped_gemm import tiles_for as grouped_tiles_for
    from engine.kernels.moe.pairs import _down_kernel, _gate_up_kernel, tiles_for
    from engine.kernels.moe.router import _softmax_topk_kernel

    bf16 = dict(X="*bf16", W13="*bf16", W2="*bf16", Act="*bf16", Out="*bf16", TopkWeights="*fp32",
                K="i32", N="i32")
    fp8 = dict(bf16, W13="*fp8e4nv", W2="*fp8e4nv", W="*fp8e4nv", Scale="*fp32")
    for tokens, (types, scaled) in itertools.product((1, 4), ((bf16, False), (fp8, True))):
        gate_up, down = tiles_for(tokens)  # the tiles the per-pair path launches
        compile_for_sm90(_gate_up_kernel, types, dict(TOP_K=8, BLOCK_N=gate_up.block_n,
                                                      BLOCK_K=gate_up.block_k, HAS_SCALE=scaled),
                         num_warps=gate_up.num_warps, num_stages=gate_up.num_stages)
        compile_for_sm90(_down_kernel, types, dict(BLOCK_N=down.block_n, BLOCK_K=down.block_k,
                                                   HAS_SCALE=scaled),
                         num_warps=down.num_warps, num_stages=down.num_stages)
    compile_for_sm90(_softmax_topk_kernel, dict(Logits="*bf16", Weights="*fp32"),
                     dict(TOP_K=8, RENORMALIZE=True, BLOCK_E=128, BLOCK_TOPK=8))
    align = dict(TopkIds="*i64", Counts="*i32", ChunkBase="*i32", SortedPairs="*i64",
                 BlockExpert="*i64")
    compile_for_sm90(_count_kernel, align, dict(BLOCK_E=256, CHUNK=128))
    for block_m in (16, 32, 64, 128):
        compile_for_sm90(_offsets_kernel, align, dict(BLOCK_M=block_m, BLOCK_E=256, TILE=64),
                         num_warps=8)
    compile_for_sm90(_scatter_kernel, align, dict(BLOCK_E=256, CHUNK=128), num_warps=8)
    grouped = dict(A="*bf16", W="*bf16", C="*bf16", PairWeights="*fp32", N="i32", K="i32")
    grouped_fp8 = dict(grouped, W="*fp8e4nv", Scale="*fp32")
    for block_m, (types, scaled) in itertools.product((16, 32, 64, 128),
                                                      ((grouped, False), (grouped_fp8, True))):
        for rows_per_a, tiles in zip((8, 1), grouped_tiles_for(block_m)):
            compile_for_sm90(_grouped_gemm_kernel, types,
                             dict(ROWS_PER_A=rows_per_a, WEIGHTED=rows_per_a == 1, PRECISION="tf32",
                                  BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                                  HAS_SCALE=scaled),
                             num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    compile_for_sm90(_sum_choices_kernel, dict(PerPair="*bf16", Out="*bf16"), dict(TOP_K=8, BLOCK=1024))
