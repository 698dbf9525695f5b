"""Shared fixtures: tiny random HF models, built once per test session into a temp dir."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `engine` importable from any cwd

from engine.loading.demo_model import ARCHS, build_tiny_model  # noqa: E402

# engines start without freezing the GC (engine/runtime/gc_freeze.py; tests/test_gc_freeze.py turns
# it on): its collection at every start would add minutes to a suite of hundreds of engines
os.environ.setdefault("RADIXSERVE_GC_FREEZE", "0")


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """`make(arch="llama", **overrides) -> path`; each distinct build happens once per session."""
    root = tmp_path_factory.mktemp("tiny-models")
    built: dict[str, str] = {}

    def make(arch: str = "llama", **overrides) -> str:
        key = arch + "".join(f"-{k}={overrides[k]}" for k in sorted(overrides))
        if key not in built:
            built[key] = build_tiny_model(root / key, arch, **overrides)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tiny_llama3(tiny_model_factory) -> str:
    return tiny_model_factory("llama3")


@pytest.fixture(scope="session")
def tiny_mistral(tiny_model_factory) -> str:
    return tiny_model_factory("mistral")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_model_factory) -> str:
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_model_factory) -> str:
    return tiny_model_factory("qwen3")


@pytest.fixture(scope="session", params=ARCHS)
def tiny_model_any(request, tiny_model_factory) -> tuple[str, str]:
    """(arch, path) for every demo architecture: a test using it runs once per arch."""
    return request.param, tiny_model_factory(request.param)
