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


def hf_top_k_tree(path: str, prompt_ids: list[int], top_k: int, temperature: float,
                  max_tokens: int) -> tuple[dict[tuple, dict[int, float]], dict[tuple, float]]:
    """Sampling `max_tokens` tokens with top-k at `temperature`, exactly: (`tops`: for each
    reachable output prefix, the next token's distribution; `joint`: the probability of
    each complete output)."""
    def top(out: tuple) -> dict[int, float]:
        values, ids = hf_next_logprobs(path, prompt_ids + list(out)).topk(top_k)
        return dict(zip(ids.tolist(), torch.softmax(values / temperature, 0).tolist()))

    tops = {(): top(())}
    for length in range(1, max_tokens):
        for out in [o for o in tops if len(o) == length - 1]:
            for t in tops[out]:
                tops[out + (t,)] = top(out + (t,))
    joint = {}
    for out in (o for o in tops if len(o) == max_tokens - 1):
        for t, p_last in tops[out].items():
            p = p_last
            for i in range(len(out)):
                p *= tops[out[:i]][out[i]]
            joint[out + (t,)] = p
    return tops, joint
