"""Model registry and loading: HF config -> our model class -> weights (or dummy init).

Reading the config and choosing the device and dtype live in engine/loading/hf_config.py,
below the models, for what needs them without building one."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from engine.layers.parallel import TPContext
from engine.loading.hf_config import load_hf_config, resolve_device, resolve_dtype
from engine.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.moe import (MixtralForCausalLM, MoEForCausalLM, Qwen2MoeForCausalLM,
                               Qwen3MoeForCausalLM)
from engine.models.phi3 import Phi3ForCausalLM

logger = logging.getLogger(__name__)

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}

def get_model_class(hf_config: Any) -> type[nn.Module]:
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_CLASSES:
            return MODEL_CLASSES[arch]
    raise ValueError(f"unsupported model architecture(s) {archs or '(none in config.json)'}; "
                     f"supported: {', '.join(MODEL_CLASSES)}")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # Layers allocate parameters with the ambient default dtype: set it for the build only.
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(model_dir: str, *, dtype: str | torch.dtype = "auto", device: str | torch.device = "auto",
               load_format: str = "safetensors", seed: int = 0, tp: TPContext | None = None,
               hf_config: Any = None, moe_parallel: str = "tp",
               quantization: str | None = None) -> nn.Module:
    """Build the model for `model_dir`'s config.json directly on `device` in `dtype`, then
    fill it from the safetensors shards (this rank's slices only) or with dummy weights.
    `moe_parallel` ("tp" or "ep") splits an MoE model's experts across TP ranks (see
    engine/layers/moe.py). FP8: a checkpoint's `quantization_config`, or `quantization="fp8"`
    (quantize after loading); see engine/quantization/."""
    from engine.loading.checkpoint_formats import fp8_scheme
    from engine.loading.weights import dummy_init_

    tp = tp or TPContext()
    hf_config = hf_config if hf_config is not None else load_hf_config(model_dir)
    model_cls = get_model_class(hf_config)
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, hf_config, device)
    scheme = fp8_scheme(hf_config, quantization)
    if scheme is not None and scheme.prequantized and issubclass(model_cls, MoEForCausalLM):
        raise ValueError(f"pre-quantized FP8 checkpoints of MoE models ({model_cls.__name__}) are "
                         "not supported yet; load the bf16 checkpoint with quantization='fp8'")
    with _default_dtype(torch_dtype), device:
        options = {"moe_parallel": moe_parallel} if issubclass(model_cls, MoEForCausalLM) else {}
        model = model_cls(hf_config, None, tp, **options)
    if load_format == "dummy":
        dummy_init_(model, seed)
    elif load_format == "safetensors":
        _load_checkpoint(model, model_dir, hf_config, tp, scheme)
    else:
        raise ValueError(f"load_format must be 'safetensors' or 'dummy', got {load_format!r}")
    if scheme is not None and not (scheme.prequantized and load_format == "safetensors"):
        from engine.layers.fp8 import quantize_linears_

        quantize_linears_(model)  # on-the-fly (or dummy weights standing in for an FP8 checkpoint)
    logger.info("loaded %s (%s, %s) from %s", model_cls.__name__, torch_dtype, device, model_dir)
    return model.eval()


def _load_checkpoint(model: nn.Module, model_dir: str, hf_config: Any, tp: TPContext,
                     scheme: Any) -> None:
    from engine.loading.checkpoint_formats import read_fp8_checkpoint, reject_float8
    from engine.layers.fp8 import make_fp8_linears_
    from engine.loading.weights import checkpoint_weights, tensor_shapes

    weights = checkpoint_weights(model_dir, hf_config, lazy=tp.size > 1)
    if scheme is not None and scheme.prequantized:
        make_fp8_linears_(model, scheme.block[1] if scheme.block else None, scheme.quantize_input)
        weights = read_fp8_checkpoint(weights, scheme, tensor_shapes(model_dir))
    else:
        weights = reject_float8(weights)
    missing = model.missing_weights(model.load_weights(weights))
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights: {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else ""))


__all__ = ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Gemma3ForCausalLM",
           "LlamaForCausalLM", "MixtralForCausalLM", "MODEL_CLASSES", "Phi3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "get_model_class",
           "load_hf_config", "load_model", "resolve_device", "resolve_dtype"]
