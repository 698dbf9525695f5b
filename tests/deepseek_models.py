"""Tiny random-weight DeepSeek-V2 / V3 directories (transformers' classes, saved in float32)
for tests/test_deepseek.py and tests/test_mla_decode.py: every MLA and routing feature at a
value that matters at this size."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from hf_reference import vocab_size_of

COMMON = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=16,
              qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2,
              n_group=4, topk_group=2, first_k_dense_replace=1, initializer_range=0.2,
              max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)


def _save(config, path, tokenizer_from: str) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if "norm" in name:
                tensor.add_(torch.randn_like(tensor) * 0.1)
            elif "e_score_correction_bias" in name:  # zeros at init: make it choose
                tensor.copy_(torch.randn_like(tensor) * 0.3)
    model.save_pretrained(path)
    for f in Path(tokenizer_from).glob("tokenizer*"):
        shutil.copy(f, path)
    return str(path)


def deepseek_v2_dir(path, tokenizer_from: str) -> str:
    """V2-Lite's shape (no query LoRA), softmax routing limited to the best expert groups,
    scaled weights, YaRN RoPE whose mscale also scales the softmax."""
    from transformers import DeepseekV2Config

    config = DeepseekV2Config(
        vocab_size=vocab_size_of(tokenizer_from), q_lora_rank=None, n_shared_experts=2,
        topk_method="group_limited_greedy", routed_scaling_factor=1.5, norm_topk_prob=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
        **COMMON)
    return _save(config, path, tokenizer_from)


def deepseek_v3_dir(path, tokenizer_from: str) -> str:
    """Query LoRA, sigmoid routing with the score-correction bias, renormalised and scaled
    weights, interleaved RoPE."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(vocab_size=vocab_size_of(tokenizer_from), q_lora_rank=48,
                              n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                              **COMMON)
    return _save(config, path, tokenizer_from)
