"""Tiny random Mixtral / Qwen2-MoE / Qwen3-MoE checkpoints in the Hugging Face hub layout
(one matrix per expert), with the demo tokenizer, for comparisons with transformers."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "generation_config.json")


@pytest.fixture(scope="session")
def moe_factory(tmp_path_factory, tiny_model_factory):
    """`make(arch, **config_overrides) -> path`, each build once per session (import it into
    a test module to use it)."""
    root = tmp_path_factory.mktemp("tiny-moe")
    tokenizer_dir = tiny_model_factory("qwen2")
    built: dict[str, str] = {}

    def make(arch: str, **overrides) -> str:
        key = arch + "".join(f"-{k}={overrides[k]}" for k in sorted(overrides))
        if key not in built:
            built[key] = build_tiny_moe(root / key, arch, tokenizer_dir, **overrides)
        return built[key]

    return make


def moe_config(arch: str, vocab_size: int, **overrides):
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                  dtype="float32")
    if arch == "mixtral":
        cls = transformers.MixtralConfig
        common.update(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                      sliding_window=None)
    elif arch == "qwen2_moe":
        # Three layers, the middle one dense: decoder_sparse_step / mlp_only_layers are honoured.
        cls = transformers.Qwen2MoeConfig
        common.update(num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=False, mlp_only_layers=[1], tie_word_embeddings=True)
    elif arch == "qwen3_moe":
        cls = transformers.Qwen3MoeConfig
        common.update(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=3, norm_topk_prob=True, head_dim=32)
    else:
        raise ValueError(f"unknown MoE arch {arch!r}")
    common.update(overrides)
    config = cls(**common)
    config.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    return config


def build_tiny_moe(out: Path, arch: str, tokenizer_dir: str, seed: int = 0, std: float = 0.3,
                   **overrides) -> str:
    """Write a random `arch` checkpoint to `out` (HF's save_pretrained: the hub's per-expert
    names), weights from our own seeded generator so the build is reproducible."""
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, out / name)
    config = moe_config(arch, _vocab_size(tokenizer_dir), **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                value = 2.0 + 0.2 * torch.randn(param.shape, generator=gen)  # as the demo models
            elif name.endswith("norm.weight"):
                value = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
            else:
                value = std * torch.randn(param.shape, generator=gen)
            param.copy_(value)
    model.save_pretrained(out)
    return str(out)


def _vocab_size(tokenizer_dir: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tokenizer_dir).vocab_size
