"""Greedy reference outputs from Hugging Face transformers, for comparisons."""
from __future__ import annotations

import contextlib
import functools
import os

import torch


@functools.lru_cache(maxsize=8)
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@contextlib.contextmanager
def one_gguf_parse():
    """transformers opens a GGUF once for its config and once for its weights, and gguf-py's
    `GGUFReader` takes tens of seconds per open on a large vocabulary: inside this block each
    file is parsed once (the reader is read-only, a memory map)."""
    import gguf

    real = gguf.GGUFReader
    readers: dict[tuple, object] = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real


def load_hf_gguf(gguf_path: str, with_tokenizer: bool = False):
    """A fresh transformers model (float32, eval) dequantized from `gguf_path`, and its
    tokenizer if asked, with the file parsed once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    with one_gguf_parse():
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                     dtype=torch.float32).eval()
        if not with_tokenizer:
            return model
        return model, AutoTokenizer.from_pretrained(folder, gguf_file=name)


@functools.lru_cache(maxsize=2)
def shared_hf_gguf(gguf_path: str):
    """`load_hf_gguf(gguf_path, with_tokenizer=True)` once per test session, for the files
    that compare against the same model (they only run it, never change it)."""
    return load_hf_gguf(gguf_path, with_tokenizer=True)


def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF `generate` greedy continuation, EOS disabled so lengths are fixed."""
    model = _hf_model(path)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def hf_argmax_given(model, prompt: list[int], new_tokens: list[int]
                    ) -> tuple[list[int], list[float]]:
    """transformers' argmax and its logprob at each position of `new_tokens`, given the
    prompt and the tokens before it, in one forward: equal to `new_tokens` exactly when they
    are `model`'s greedy continuation (one forward instead of a decode step per token)."""
    with torch.no_grad():  # the vocabulary projection of the last len(new_tokens) positions only
        logits = model(torch.tensor([prompt + new_tokens[:-1]]),
                       logits_to_keep=len(new_tokens)).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = logprobs.argmax(dim=-1)
    return best.tolist(), logprobs.gather(1, best[:, None])[:, 0].tolist()


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


def hf_greedy_logprobs(path: str, prompt_ids: list[int], max_new_tokens: int
                       ) -> tuple[list[int], list[float]]:
    """`hf_greedy`'s tokens with each one's logprob (from generate's own logits)."""
    model = _hf_model(path)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    return tokens, [torch.log_softmax(step[0].float(), -1)[t].item()
                    for step, t in zip(out.logits, tokens)]


def save_tiny_hf_model(config, path, tokenizer_from: str, norm_std: float = 0.0) -> str:
    """A random-weight transformers model of `config` saved in float32 to `path`, with the
    tokenizer files of the model directory `tokenizer_from` (for the engine's detokenizer);
    `norm_std` > 0 adds noise to the norm weights (whose init is constant)."""
    import shutil
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if norm_std and "norm" in name:
                param.add_(torch.randn_like(param) * norm_std)
    model.save_pretrained(path)
    for f in Path(tokenizer_from).glob("tokenizer*"):
        shutil.copy(f, path)
    return str(path)


def vocab_size_of(model_dir: str) -> int:
    import json
    from pathlib import Path

    return json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
