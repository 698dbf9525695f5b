"""GGUF checkpoints (llama.cpp's one-file format), read in place: the config and the
tokenizer (with its chat template) come from the file's metadata, the tensors are
dequantized to float32 one at a time as the model loads them. Nothing is written to disk.

Supported: the `llama` (also Mistral and SmolLM files), `qwen2`, `qwen3` and `gemma3` architectures;
tensor types F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q2_K..Q6_K.
"""
from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from engine.loading.gguf_file import GGUFFile, read_gguf

# GGUF architecture -> (HF model_type, HF architecture class name).
ARCHS = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# GGUF tensor names -> ours (HF's). `{}` is the layer index.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Where an architecture's layer names differ from the table above.
_ARCH_LAYER_NAMES = {
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm",
               "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def is_gguf(path: str) -> bool:
    return str(path).endswith(".gguf") and os.path.isfile(path)


@functools.lru_cache(maxsize=4)
def _reader(path: str) -> GGUFFile:
    return read_gguf(path)  # memory-maps the file: tensors are read when touched


def metadata(path: str, key: str, default: Any = None) -> Any:
    value = _reader(path).fields.get(key)
    return default if value is None else value


def architecture(path: str) -> str:
    arch = metadata(path, "general.architecture")
    if arch not in ARCHS:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(ARCHS)}")
    return arch


def gguf_config(path: str) -> Any:
    """A transformers config built from the GGUF metadata (`{arch}.*` keys)."""
    from transformers import AutoConfig

    arch = architecture(path)
    model_type, class_name = ARCHS[arch]

    def meta(key: str, default: Any = None) -> Any:
        return metadata(path, f"{arch}.{key}", default)

    names = {t.name for t in _reader(path).tensors}
    if "rope_freqs.weight" in names:  # Llama 3.1's rope scaling, stored as a tensor
        raise ValueError(f"{path}: GGUF rope_freqs (Llama 3.1 RoPE scaling) is not supported; "
                         "use the Hugging Face checkpoint")
    heads = meta("attention.head_count")
    kwargs = dict(
        architectures=[class_name],
        vocab_size=meta("vocab_size") or len(metadata(path, "tokenizer.ggml.tokens")),
        hidden_size=meta("embedding_length"),
        intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=meta("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=meta("attention.head_count_kv", heads),
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon", 1e-6),
        max_position_embeddings=meta("context_length", 4096),
        rope_theta=meta("rope.freq_base", 10000.0),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=metadata(path, "tokenizer.ggml.bos_token_id"),
        eos_token_id=metadata(path, "tokenizer.ggml.eos_token_id"),
    )
    if meta("attention.key_length") is not None:  # Qwen3 sets head_dim apart from hidden/heads
        kwargs["head_dim"] = meta("attention.key_length")
    if meta("attention.sliding_window") is not None:  # Gemma 3's window layers
        kwargs["sliding_window"] = meta("attention.sliding_window")
    scaling = rope_scaling(path, meta)
    if scaling is not None:
        kwargs["rope_scaling"] = scaling
    return AutoConfig.for_model(model_type, **kwargs)


# llama.cpp YaRN settings whose values here mean "as transformers computes it"
# (yarn_ext_factor: negative = llama.cpp's default, 1 = the full ramp).
_YARN_NEUTRAL = {
    "attn_factor": lambda v: v == 1.0,
    "yarn_attn_factor": lambda v: v == 1.0,
    "yarn_log_multiplier": lambda v: v == 0.0,
    "yarn_ext_factor": lambda v: v < 0 or v == 1.0,
}


def rope_scaling(path: str, meta: Any) -> dict | None:
    """llama.cpp's `rope.scaling.*` keys as a transformers `rope_scaling` dict (None for plain
    RoPE): linear, and YaRN with its factor, original context and betas. llama.cpp's other
    YaRN knobs change the math in ways transformers has no field for: refused when set."""
    kind = meta("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = meta("rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind != "yarn":
        raise ValueError(f"{path}: GGUF rope scaling {kind!r} is not supported (none, linear, yarn)")
    for key, is_neutral in _YARN_NEUTRAL.items():
        value = meta(f"rope.scaling.{key}")
        if value is not None and not is_neutral(value):
            raise ValueError(f"{path}: GGUF rope.scaling.{key}={value} is not supported")
    params = {"rope_type": "yarn", "factor": factor,
              "original_max_position_embeddings": meta("rope.scaling.original_context_length")}
    for ours, theirs in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
        if meta(f"rope.scaling.{theirs}") is not None:
            params[ours] = meta(f"rope.scaling.{theirs}")
    return params


def iterate_gguf(path: str, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, float32 CPU tensor) for every tensor of the file, dequantized one by one."""
    from gguf.quants import dequantize

    arch = architecture(path)
    for tensor in _reader(path).tensors:
        type_name = tensor.tensor_type.name
        if type_name not in SUPPORTED_TYPES:
            raise ValueError(f"{path}: tensor {tensor.name} has GGUF type {type_name}, which "
                             f"radixserve cannot dequantize; supported: {', '.join(SUPPORTED_TYPES)}")
        name = hf_name(tensor.name, arch)
        # GGUF lists dimensions innermost first; torch outermost first.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        # F32 tensors come back as views of the read-only memory map: copy those.
        weight = torch.from_numpy(np.array(values, dtype=np.float32, copy=not values.flags.writeable))
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = hf_config.num_attention_heads if "q_proj" in name else hf_config.num_key_value_heads
            weight = unpermute_rope(weight, heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            weight = weight - 1  # llama.cpp stores Gemma's (1 + w); checkpoints hold w
        yield name, weight


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    m = _LAYER_TENSOR.fullmatch(gguf_name)
    if m is None or m.group(2) not in names:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in our models")
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"


def unpermute_rope(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter reorders each head's q/k rows from HF's rotate-half layout
    (first half, second half) to interleaved pairs; put them back."""
    rows = weight.shape[0]
    return (weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))
