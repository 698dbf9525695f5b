"""Programmatic dependent launch (engine/kernels/launch.py), checked without a GPU: every Triton
kernel the engine launches takes the `PDL` switch, each waits for the previous kernel
before it touches memory (compiled for sm_90: here for the element-wise kernels, and in
every other `compile_for_sm90` test through `assert_waits_before_memory`), and PDL stays off
where it cannot run. The GPU tests run with it on (tests/test_gpu_engine.py compares whole
models against HF with CUDA graphs, where PDL edges are captured)."""
from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch
import triton

import engine
from engine.kernels.launch import pdl_launch


def engine_kernels() -> dict[str, triton.JITFunction]:
    """Every @triton.jit function named *_kernel in the engine's modules that import triton."""
    found = {}
    for info in pkgutil.walk_packages(engine.__path__, "engine."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # optional dependencies (xgrammar, ray) absent here
            continue
        for name, obj in vars(module).items():
            if isinstance(obj, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                found[f"{obj.__module__}.{name}"] = obj
    return found


def test_every_engine_kernel_takes_the_pdl_switch():
    kernels = engine_kernels()
    assert len(kernels) >= 17, sorted(kernels)  # attention, fused, FP8 and MoE kernels
    missing = [name for name, fn in kernels.items() if "PDL" not in fn.arg_names]
    assert not missing, f"launched under PDL without a prologue: {missing}"


def test_elementwise_kernels_wait_before_memory_on_hopper():
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend")
    from triton_on_cpu import compile_for_sm90

    from engine.kernels.fused import _rmsnorm_kernel, _silu_and_mul_kernel

    for residual in (False, True):
        compile_for_sm90(_rmsnorm_kernel, dict(X="*bf16", R="*bf16", W="*bf16", Out="*bf16",
                                               ResOut="*bf16", eps="fp32"),
                         dict(HAS_RESIDUAL=residual, BLOCK=4096), num_warps=16)
    compile_for_sm90(_silu_and_mul_kernel, dict(X="*bf16", Out="*bf16"), dict(BLOCK=1024))


def test_the_check_catches_a_kernel_that_reads_first():
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend")
    import triton.language as tl
    from triton_on_cpu import compile_for_sm90

    from engine.kernels.launch import pdl_prologue

    @triton.jit
    def reads_first_kernel(X, Y, PDL: tl.constexpr = False):
        x = tl.load(X + tl.arange(0, 128))
        pdl_prologue(PDL)
        tl.store(Y + tl.arange(0, 128), x)

    with pytest.raises(AssertionError, match="before griddepcontrol.wait"):
        compile_for_sm90(reads_first_kernel, dict(X="*fp32", Y="*fp32"), {})


def test_pdl_is_off_without_a_hopper_gpu(monkeypatch):
    assert pdl_launch(torch.device("cpu")) == {}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from engine.kernels import launch as pdl

    pdl._enabled.cache_clear()
    try:
        assert not pdl._enabled(0)
    finally:
        pdl._enabled.cache_clear()


def test_an_engine_config_turns_pdl_off(tiny_llama):
    """`kernels.pdl=False` reaches every launch site through the process's kernel settings
    (engine/kernels/launch.py), applied when a model runner is built; the next engine's
    config applies in turn."""
    from engine.config import EngineConfig
    from engine.executor.model_runner import ModelRunner
    from engine.models import load_model
    from engine.kernels import launch as pdl
    from engine.kernels.launch import kernel_settings

    try:
        ModelRunner(EngineConfig(model=tiny_llama, device="cpu", kernels={"pdl": False}),
                    load_model=load_model)
        assert not kernel_settings().pdl
        pdl._enabled.cache_clear()
        # a Hopper GPU would be asked for its capability only when PDL is wanted
        assert not pdl._enabled(0, kernel_settings().pdl)
        ModelRunner(EngineConfig(model=tiny_llama, device="cpu"), load_model=load_model)
        assert kernel_settings().pdl
    finally:
        pdl._enabled.cache_clear()
