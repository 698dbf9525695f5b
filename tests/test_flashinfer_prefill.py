"""FlashInfer's Hopper prefill for large extend steps (engine/attention/flashinfer_prefill.py).

CPU: which steps it takes, the key gather and the plan's lengths, and the start-up errors
when it is asked for and cannot serve. GPU (`-m gpu`; FlashInfer installed, an sm_90 GPU):
the Triton backend with FlashInfer against the torch reference on long extends, mixed steps
and steps that stay on Triton, and the engine's prompt logprobs and tokens with and without
it, with overlapped steps that never wait for the GPU."""
from __future__ import annotations

import importlib
import importlib.util
import os
import random
import shutil
import subprocess

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.attention import flashinfer_prefill
from engine.attention.flashinfer_prefill import host_indptr, key_slots, worth_it


def test_large_extends_go_to_flashinfer_and_small_ones_stay():
    assert worth_it([4096])
    assert worth_it([1024] * 4)  # measured 1.43x faster (over 1,024-token prefixes)
    assert worth_it([8192, 16])  # one long chunk carries a few short prompts
    assert worth_it([512] * 8)  # fresh prompts (W1's mixed steps): measured 1.20x
    assert worth_it([256] * 16)  # 32 x 256 measured 1.29x
    assert not worth_it([4095])  # too few new tokens for the plan to pay
    assert not worth_it([2048])
    assert not worth_it([64] * 64)  # many short extends: FlashInfer measured slower
    assert not worth_it([128] * 40)
    assert not worth_it([])


def test_key_slots_follow_each_request_row():
    req_to_token = torch.arange(5 * 10, dtype=torch.int32).view(5, 10)
    rows, lens = torch.tensor([3, 1, 4]), torch.tensor([2, 0, 4], dtype=torch.int32)
    got = key_slots(req_to_token, rows, lens, 6)
    assert got.tolist() == [30, 31, 40, 41, 42, 43]
    assert host_indptr([2, 0, 4]).tolist() == [0, 2, 2, 6]
    assert host_indptr([2, 0, 4]).dtype == torch.int32


def test_flashinfer_refuses_the_cpu_with_its_reason():
    reason = flashinfer_prefill.unavailable_reason(torch.device("cpu"), torch.bfloat16)
    assert "CUDA GPU" in reason


def test_asking_for_flashinfer_on_the_cpu_fails_at_start(tiny_llama):
    with pytest.raises(ValueError, match="prefill_attention_backend='flashinfer' needs the Triton"):
        LLM(model=tiny_llama, dtype="float32", device="cpu", prefill_attention_backend="flashinfer")
    with pytest.raises(ValueError, match="prefill_attention_backend must be"):
        EngineConfig(model=tiny_llama, prefill_attention_backend="fa3")
    # "auto" on the CPU is the torch backend, as before
    llm = LLM(model=tiny_llama, dtype="float32", device="cpu", max_total_tokens=256)
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0))[0].token_ids


def test_a_flashinfer_that_cannot_build_leaves_auto_on_triton(tiny_llama, monkeypatch, caplog):
    """"auto" where FlashInfer looks usable but fails to build (here: it is not installed,
    so its import fails inside the build) starts on Triton with a warning; asked for
    explicitly, the same failure stops the start."""
    if importlib.util.find_spec("flashinfer") is not None:
        pytest.skip("FlashInfer is installed here: its import would not fail")
    monkeypatch.setattr(flashinfer_prefill, "unavailable_reason", lambda device, dtype: None)
    monkeypatch.setattr(flashinfer_prefill, "kernel_is_built", lambda dtype, head_dim: True)
    kw = dict(model=tiny_llama, dtype="float32", device="cpu", attention_backend="triton",
              max_total_tokens=256)
    with caplog.at_level("WARNING", logger="engine.executor.model_runner"):
        llm = LLM(**kw)
    assert llm.engine.runner.attn_backend.flashinfer is None
    assert "could not be built (ModuleNotFoundError" in caplog.text
    with pytest.raises(ModuleNotFoundError, match="flashinfer"):
        LLM(**kw, prefill_attention_backend="flashinfer")


def test_auto_takes_flashinfer_only_when_its_kernel_is_built(tiny_llama, monkeypatch, caplog):
    """"auto" never adds FlashInfer's two-minute compile to a start: with its kernel not
    built it starts on Triton and says how to get FlashInfer (the build itself is not
    attempted: the import that would fail here is never reached)."""
    monkeypatch.setattr(flashinfer_prefill, "unavailable_reason", lambda device, dtype: None)
    asked = []
    monkeypatch.setattr(flashinfer_prefill, "kernel_is_built",
                        lambda dtype, head_dim: asked.append((dtype, head_dim)) or False)
    with caplog.at_level("INFO", logger="engine.executor.model_runner"):
        llm = LLM(model=tiny_llama, dtype="float32", device="cpu", attention_backend="triton",
                  max_total_tokens=256)
    assert llm.engine.runner.attn_backend.flashinfer is None
    assert asked == [(torch.float32, llm.engine.runner.attn_backend.head_dim)]
    assert "is not built, or its build is not current, on this machine" in caplog.text
    assert "could not be built" not in caplog.text


class _CachedModule:
    """The part of FlashInfer's JIT spec that `kernel_is_built` reads, over a real ninja build
    (a copy standing in for nvcc)."""
    is_aot = False

    def __init__(self, root) -> None:
        self.build_dir, self.ninja_path = root, root / "build.ninja"
        (root / "kernel.cu").write_text("source")

    def write_ninja(self) -> None:
        self.ninja_path.write_text("rule nvcc\n  command = cp $in $out\n"
                                   "build module.so: nvcc kernel.cu\n")

    @property
    def is_compiled(self) -> bool:
        return (self.build_dir / "module.so").exists()


def test_kernel_is_built_only_when_ninja_would_not_rebuild_it(tmp_path, monkeypatch):
    """A JIT cache holding the library but not its build state (objects, ninja's log), or older
    than its sources, is rebuilt by FlashInfer at the first plan: "auto" must not count it
    as built."""
    ninja = shutil.which("ninja") or os.path.join(importlib.import_module("ninja").BIN_DIR, "ninja")
    monkeypatch.setenv("PATH", f"{os.path.dirname(ninja)}{os.pathsep}{os.environ['PATH']}")
    spec = _CachedModule(tmp_path)
    monkeypatch.setattr(flashinfer_prefill, "_fa3_spec", lambda dtype, head_dim: spec)
    assert not flashinfer_prefill.kernel_is_built(torch.bfloat16, 128)  # never built
    spec.write_ninja()
    subprocess.run([ninja, "-C", str(tmp_path)], check=True, capture_output=True)
    assert flashinfer_prefill.kernel_is_built(torch.bfloat16, 128)
    os.remove(tmp_path / ".ninja_log")  # the library alone, as a cache copied without its build
    assert not flashinfer_prefill.kernel_is_built(torch.bfloat16, 128)
    subprocess.run([ninja, "-C", str(tmp_path)], check=True, capture_output=True)
    later = os.path.getmtime(tmp_path / "module.so") + 10
    os.utime(tmp_path / "kernel.cu", (later, later))  # FlashInfer reinstalled: newer sources
    assert not flashinfer_prefill.kernel_is_built(torch.bfloat16, 128)


def test_kernel_is_built_says_no_without_flashinfer():
    if importlib.util.find_spec("flashinfer") is not None:
        pytest.skip("FlashInfer is installed here")
    assert flashinfer_prefill.kernel_is_built(torch.bfloat16, 128) is False


def _serves() -> bool:
    return (torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None
            and flashinfer_prefill.unavailable_reason(torch.device("cuda"), torch.bfloat16) is None)


needs_flashinfer = pytest.mark.skipif(not _serves(), reason="needs FlashInfer on an sm_90 GPU")

# head_dim 128, bf16: the kernel FlashInfer builds for Llama-3-shaped models (one JIT build)
CASES = [
    ("one_long_prompt", [(0, 4096)], 1),
    ("chunks_over_prefixes", [(3000, 2048), (0, 1500), (700, 1200)], 1),
    ("decoders_then_a_chunk", [(500, 1)] * 5 + [(1000, 4096)], 1),
    ("fresh_short_prompts", [(0, 512)] * 7 + [(0, 700)], 1),
    ("short_extends_stay_on_triton", [(1216, 64)] * 8 + [(0, 2048)], 0),
]


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("fused_qkv", [True, False], ids=["strided_q", "contiguous_q"])
def test_backend_with_flashinfer_matches_torch(case, fused_qkv):
    from test_triton_attention import compare, make_case, reference

    from engine.attention.triton_backend import TritonAttentionBackend

    _, reqs, planned = case
    c = make_case(reqs, 32, 8, 128, torch.bfloat16, "cuda", fused_qkv=fused_qkv, seed=7)
    ref, ref_pool = reference(c)
    be = TritonAttentionBackend(c.pool, 128 ** -0.5)
    be.use_flashinfer_prefill(flashinfer_prefill.FlashInferPrefill(
        torch.device("cuda"), 128 ** -0.5, 32, 8, 128, torch.bfloat16))
    be.prepare(c.batch)
    out = torch.full(c.q.shape, float("nan"), dtype=c.q.dtype, device="cuda")
    be.forward(c.q, c.k, c.v, c.layer, c.batch, out=out)
    assert be.flashinfer.steps == planned
    r = compare(c, out, ref, ref_pool)
    assert r["ok"], r


def _long_prompts(n, length, seed):
    r = random.Random(seed)
    return [[r.randint(3, 700) for _ in range(length)] for _ in range(n)]


@pytest.mark.gpu
@needs_flashinfer
def test_engine_with_flashinfer_is_as_close_to_float32_as_triton(tiny_model_factory, monkeypatch):
    """Prompt logprobs of 3,000-token prompts (their prefill chunks through FlashInfer) and
    greedy tokens, against the same engine in float32: the bf16 engine with FlashInfer is as
    close as the bf16 engine with Triton alone (the random tiny model amplifies bf16
    rounding, so both differ from float32 by a similar, nonzero amount). Every overlapped
    launch of the FlashInfer engine runs under torch's sync debug mode (the plan's host
    copies must not wait for the GPU)."""
    from engine_steps import never_syncing

    from engine.runtime.overlap import OverlapStepper

    # init_std 0.1: bf16 against float32 moves a prompt logprob by ~0.08 on average (on the
    # CPU, 600-token prompts); at the default 0.3 the model is chaotic (~0.8-1.0)
    path = tiny_model_factory("llama", init_std=0.1, hidden_size=512, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=8192)

    ps = _long_prompts(3, 3000, seed=5) + _long_prompts(4, 40, seed=6)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs_start=0)
    runs = {}
    for name, dtype, prefill in (("float32", "float32", "triton"), ("triton", "bfloat16", "triton"),
                                 ("flashinfer", "bfloat16", "flashinfer")):
        if prefill == "flashinfer":
            monkeypatch.setattr(OverlapStepper, "_forward", never_syncing(OverlapStepper._forward))
        llm = LLM(model=path, dtype=dtype, device="cuda", max_total_tokens=16384,
                  chunked_prefill_size=4096, cuda_graph_max_bs=8, prefill_attention_backend=prefill)
        runs[name] = llm.generate(ps, params)
        fi = llm.engine.runner.attn_backend.flashinfer
        assert (fi is not None and fi.steps > 0) == (prefill == "flashinfer")
        s = llm.stats()
        assert s["free_slots"] + s["evictable_slots"] == s["total_slots"]

    def error(name):  # mean and max |logprob - float32's| over every prompt token, tokens equal
        d = [abs(a - b) for x, y in zip(runs[name], runs["float32"])
             for a, b in zip(x.prompt_logprobs, y.prompt_logprobs) if a is not None]
        same = sum(x.token_ids == y.token_ids for x, y in zip(runs[name], runs["float32"]))
        return len(d), sum(d) / len(d), max(d), same

    assert flashinfer_prefill.kernel_is_built(torch.bfloat16, 128)  # so "auto" takes it now
    tri, fi = error("triton"), error("flashinfer")
    print("vs float32 (tokens, mean, max, equal outputs): triton", tri, "flashinfer", fi)
    assert tri[0] == fi[0] == 3 * 2999 + 4 * 39
    assert fi[1] <= 1.25 * tri[1] + 1e-3, (tri, fi)
    assert fi[3] >= tri[3] - 1, (tri, fi)
