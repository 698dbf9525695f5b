"""`EngineConfig.kernels` (engine/config.py `KernelConfig`): checked at construction, carried
across processes, and handed to what reads it (engine/kernels/launch.py for the kernels'
launch sites, the sampler, the attention backend, the linears)."""
from __future__ import annotations

import dataclasses
import pickle

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.config import KernelConfig
from engine.kernels.launch import kernel_settings

ALL_OFF = {f.name: False for f in dataclasses.fields(KernelConfig) if f.type in (bool, "bool")}


def test_every_switch_is_a_bool_defaulting_on():
    assert set(ALL_OFF) == {f.name for f in dataclasses.fields(KernelConfig)} - {"bf16_gemv_rows"}
    assert all(getattr(KernelConfig(), name) is True for name in ALL_OFF)
    assert KernelConfig().bf16_gemv_rows == 1


def test_the_kernels_read_the_defaults_before_any_engine(monkeypatch):
    """engine/kernels/launch.py holds no KernelConfig of its own until one is applied."""
    from engine.kernels import launch

    monkeypatch.setattr(launch, "_current", None)
    assert all(launch.setting_on(name) == getattr(KernelConfig(), name) for name in ALL_OFF)
    monkeypatch.setattr(launch, "_current", KernelConfig(split_sums=False))
    assert not launch.split_sums_on() and launch.setting_on("pdl")


def test_checked_like_the_other_fields():
    assert EngineConfig(kernels={"pdl": False}).kernels == KernelConfig(pdl=False)
    with pytest.raises(ValueError, match=r"unknown kernel setting\(s\) \['pdl_off'\]"):
        EngineConfig(kernels={"pdl_off": False})
    with pytest.raises(ValueError, match="kernels.sort_free_cut must be bool, got 'no'"):
        EngineConfig(kernels={"sort_free_cut": "no"})
    with pytest.raises(ValueError, match="kernels must be a mapping"):
        EngineConfig(kernels=["pdl"])


def test_crosses_a_process_as_an_object_or_a_dict():
    config = EngineConfig(model="m", kernels={"split_sums": False, "bf16_gemv_rows": 16})
    assert pickle.loads(pickle.dumps(config)) == config
    assert EngineConfig(**dataclasses.asdict(config)) == config


def test_an_engine_hands_its_settings_on(tiny_llama):
    """Every path off: the owners hold their settings, the process's kernel settings are the
    engine's, and the tokens are those of the defaults (on a CPU every path is torch's)."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = [[5, 17, 42, 7, 99]]
    try:
        llm = LLM(model=tiny_llama, device="cpu", dtype="float32", max_total_tokens=1024,
                  kernels={**ALL_OFF, "bf16_gemv_rows": 8})
        engine = llm.engine
        assert kernel_settings() == engine.config.kernels and not kernel_settings().pdl
        assert not engine.sampler.sort_free_cut
        linear = engine.runner.model.model.layers[0].mlp.gate_up_proj
        assert linear.gemv_rows == 0 and not linear.glu_gemv  # CPU: fused kernels are off
        off = llm.generate(prompt, params)[0].token_ids
        del llm, engine, linear
        on = LLM(model=tiny_llama, device="cpu", dtype="float32", max_total_tokens=1024)
        assert kernel_settings() == KernelConfig()
        assert on.engine.sampler.sort_free_cut
        assert on.generate(prompt, params)[0].token_ids == off
    finally:
        from engine.kernels.launch import apply_kernel_config

        apply_kernel_config(KernelConfig())
