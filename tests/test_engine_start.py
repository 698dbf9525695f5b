"""The engine's start: the tokenizer loads beside the weight load, and its errors still reach
whoever builds the engine."""
from __future__ import annotations

import threading

import pytest

import engine.runtime.engine as engine_module
from engine import EngineConfig
from engine.runtime.engine import Engine

HANDSHAKE_S = 20.0


def test_the_tokenizer_loads_while_the_weights_load(tiny_llama, monkeypatch):
    """Each load waits for the other to have begun: run one after the other, the first
    would wait in vain and the start fails."""
    tokenizer_began, weights_began = threading.Event(), threading.Event()
    real_tokenizer, real_load_model = engine_module.Tokenizer, engine_module.load_model
    threads = {}

    def tokenizer(path):
        threads["tokenizer"] = threading.get_ident()
        tokenizer_began.set()
        assert weights_began.wait(HANDSHAKE_S), "the tokenizer loaded before the weight load began"
        return real_tokenizer(path)

    def load_model(*args, **kwargs):
        threads["weights"] = threading.get_ident()
        weights_began.set()
        assert tokenizer_began.wait(HANDSHAKE_S), "the weights loaded before the tokenizer began"
        return real_load_model(*args, **kwargs)

    monkeypatch.setattr(engine_module, "Tokenizer", tokenizer)
    monkeypatch.setattr(engine_module, "load_model", load_model)
    engine = Engine(EngineConfig(model=tiny_llama, device="cpu", max_total_tokens=256))
    assert threads["tokenizer"] != threads["weights"] == threading.get_ident()
    assert engine.tokenizer.encode("hello world")
    assert "tokenizer_wait" in engine.runner.startup.phases


def test_a_tokenizer_that_cannot_load_fails_the_start(tiny_llama, tmp_path):
    with pytest.raises(OSError):
        Engine(EngineConfig(model=tiny_llama, tokenizer=str(tmp_path / "missing"), device="cpu",
                            max_total_tokens=256))
