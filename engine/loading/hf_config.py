"""A checkpoint's Hugging Face config, and the device and dtype a model of it runs in: what
the engine reads before (or without) building the model (engine/models/__init__.py)."""
from __future__ import annotations

from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float": torch.float32, "half": torch.float16}



def load_hf_config(model_dir: str) -> Any:
    """`model_dir` may be any spelling engine/loading/model_source.py resolves, a .gguf file included."""
    from transformers import AutoConfig

    from engine.loading.model_source import resolve_model_path
    from engine.loading.gguf import gguf_config, is_gguf

    path = resolve_model_path(model_dir)
    if is_gguf(path):
        return gguf_config(path)
    return AutoConfig.from_pretrained(path, local_files_only=True)


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, hf_config: Any, device: str | torch.device) -> torch.dtype:
    """An explicit dtype is kept. "auto" is the checkpoint's dtype on GPUs, but float32 on the
    CPU, where bfloat16/float16 matmuls are slow."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
        return _DTYPES[dtype]
    if resolve_device(device).type == "cpu":
        return torch.float32
    config_dtype = getattr(hf_config, "dtype", None) or vars(hf_config).get("torch_dtype")
    if isinstance(config_dtype, str):
        config_dtype = _DTYPES.get(config_dtype)
    return config_dtype or torch.bfloat16
