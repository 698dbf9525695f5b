"""Greedy reference outputs from Hugging Face transformers, for comparisons."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF `generate` greedy continuation, EOS disabled so lengths are fixed."""
    model = _hf_model(path)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def hf_next_logprobs(path: str, token_ids: list[int]) -> torch.Tensor:
    model = _hf_model(path)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)
