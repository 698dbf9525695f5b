"""PEFT reference adapters for the LoRA tests: made with `peft` on a base model (non-zero B,
so they change the outputs), saved in PEFT's format, and kept as the reference model."""
from __future__ import annotations

import os

import torch

from hf_reference import shared_hf_gguf

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# name -> LoraConfig arguments: different ranks, targets, scalings
SPECS = {
    "qv-mlp-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"]),
    "all-r4-rslora": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=ATTN + MLP),
    "kou-r16": dict(r=16, lora_alpha=32, target_modules=["k_proj", "o_proj", "up_proj"],
                    alpha_pattern={"k_proj": 64}),
}


def load_base(base: str, gguf_file: str | None = None):
    """A fresh copy (PEFT wraps it in place); a GGUF's from the session's dequantized model
    (hf_reference.shared_hf_gguf: parsing the file takes seconds, copying the model less)."""
    import copy

    from transformers import AutoModelForCausalLM

    if gguf_file:
        return copy.deepcopy(shared_hf_gguf(os.path.join(base, gguf_file))[0])
    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()


def make_adapter(base: str, out_dir: str, seed: int = 0, gguf_file: str | None = None,
                 **lora_args):
    """Save a random adapter for `base` at `out_dir`; returns the PEFT model (eval mode)."""
    from peft import LoraConfig, get_peft_model

    model = load_base(base, gguf_file)
    torch.manual_seed(seed)
    config = LoraConfig(init_lora_weights=False, **lora_args)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # PEFT's random init gives B the scale of A: keep deltas moderate
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5)
    peft_model.save_pretrained(out_dir)
    return peft_model.eval()


def greedy_with_logprobs(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy continuation (EOS off) and each chosen token's logprob, from full forwards."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        tokens = out[0, len(prompt):].tolist()
        logits = model(out).logits[0, len(prompt) - 1:-1].float()
    logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return tokens, logprobs.tolist()
