"""Which quantization a checkpoint (or the engine config) asks for, and reading FP8 checkpoints.

Understood `quantization_config`s (config.json):
- compressed-tensors, format "float-quantized": float8 weights with `weight_scale` per tensor
  (one number), per channel ([out, 1]) or per block; `input_scale` (static activation scales)
  is dropped: activations get dynamic per-token scales, which are at least as fine;
  `input_activations: null` means weight-only (activations stay in the model dtype).
- HF FineGrainedFP8, quant_method "fp8": float8 weights with `weight_scale_inv`, one number per
  `weight_block_size` block (despite the name, the weight dequantizes as weight * scale_inv).
Anything else (AWQ, GPTQ, bitsandbytes, ...) is refused at start-up, by name.

Every scale is brought to the [out, G] float32 layout of engine/quantization/fp8.py: a
per-tensor scale repeats down the rows, a block scale repeats each block row `block_out`
times, so the fused qkv / gate_up loaders stack and split them like weight rows.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engine.layers.parallel import Loadable, materialize
from engine.layers.fp8 import loaded_dtype

logger = logging.getLogger(__name__)

_DROPPED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale")  # static activation / KV scales
_SCALE_SUFFIXES = _DROPPED_SUFFIXES + (".weight_scale", ".weight_scale_inv")


@dataclass(frozen=True)
class FP8Scheme:
    """How the model's linear layers are quantized. `checkpoint` None = quantize at load."""

    checkpoint: str | None = None  # "compressed-tensors" or "fp8"
    block: tuple[int, int] | None = None  # (out, in) block of one weight scale
    quantize_input: bool = True

    @property
    def prequantized(self) -> bool:
        return self.checkpoint is not None


def fp8_scheme(hf_config: Any, quantization: str | None) -> FP8Scheme | None:
    """The checkpoint's FP8 format, else on-the-fly FP8 when asked for, else None."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return FP8Scheme() if quantization == "fp8" else None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc)
    if method == "fp8":
        block = qc.get("weight_block_size")
        return FP8Scheme("fp8", tuple(block) if block else None)
    raise ValueError(f"checkpoint quantization {method!r} (config.json quantization_config) is not "
                     "supported; radixserve loads FP8 checkpoints only (compressed-tensors "
                     "float-quantized, or quant_method 'fp8'), or unquantized ones")


def _compressed_tensors_scheme(qc: dict) -> FP8Scheme:
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    schemes = {_compressed_tensors_group(qc, g) for g in groups}
    if len(schemes) > 1:
        raise ValueError("compressed-tensors checkpoints with differently quantized layer groups "
                         "are not supported")
    if qc.get("kv_cache_scheme"):
        logger.warning("ignoring the checkpoint's kv_cache_scheme (use kv_cache_dtype='fp8_e4m3')")
    return schemes.pop()


def _compressed_tensors_group(qc: dict, group: dict) -> FP8Scheme:
    fmt = group.get("format") or qc.get("format")
    weights = group.get("weights") or {}
    if fmt != "float-quantized" or weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise ValueError(f"compressed-tensors format {fmt!r} with {weights.get('num_bits')}-bit "
                         f"{weights.get('type')} weights is not supported (only float-quantized FP8)")
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        raise ValueError(f"compressed-tensors FP8 weight strategy {strategy!r} is not supported")
    block = tuple(weights["block_structure"]) if strategy == "block" else None
    return FP8Scheme("compressed-tensors", block, group.get("input_activations") is not None)


def reject_float8(weights: Iterable[tuple[str, Loadable]]) -> Iterator[tuple[str, Loadable]]:
    """For checkpoints without a quantization_config: float8 tensors there have no scales we
    know of, and upcasting them as they are would load a wrong model."""
    for name, loaded in weights:
        if loaded_dtype(loaded).startswith("F8") or name.endswith(_SCALE_SUFFIXES):
            raise ValueError(f"checkpoint tensor {name!r} is float8 or a float8 scale, but "
                             "config.json has no quantization_config saying how it is scaled")
        yield name, loaded


def read_fp8_checkpoint(weights: Iterable[tuple[str, Loadable]], scheme: FP8Scheme,
                        shapes: dict[str, tuple[int, ...]]) -> Iterator[tuple[str, Loadable]]:
    """Checkpoint tensors with the scales renamed to `weight_scale` and reshaped to [out, G];
    `shapes` holds every checkpoint tensor's shape (a scale may come before its weight)."""
    for name, loaded in weights:
        if name.endswith(_DROPPED_SUFFIXES):
            continue
        if name.endswith(".weight_scale_inv"):
            name = name[:-len("_inv")]
        if name.endswith(".weight_scale"):
            weight_shape = shapes[name[:-len("_scale")]]
            yield name, scale_rows(materialize(loaded).float(), weight_shape, scheme.block)
            continue
        if loaded_dtype(loaded).startswith("F8") and name + "_scale" not in shapes \
                and name + "_scale_inv" not in shapes:
            raise ValueError(f"float8 checkpoint tensor {name!r} has no weight_scale")
        yield name, loaded


def scale_rows(scale: torch.Tensor, weight_shape: tuple[int, ...],
               block: tuple[int, int] | None) -> torch.Tensor:
    """A checkpoint's weight scale as [out, G] (G = 1, or in / block_in)."""
    out, inp = weight_shape
    if scale.numel() == 1:  # per tensor
        return scale.reshape(1, 1).expand(out, 1).contiguous()
    if scale.numel() == out and block is None:  # per channel
        return scale.reshape(out, 1).contiguous()
    if block is None:
        raise ValueError(f"weight scale of shape {tuple(scale.shape)} for a {out}x{inp} weight, "
                         "but the checkpoint declares no block size")
    block_out, block_in = block
    if inp % block_in:
        raise ValueError(f"FP8 block size {block_in} does not divide the input width {inp}")
    expected = (-(-out // block_out), inp // block_in)
    if tuple(scale.shape) != expected:
        raise ValueError(f"block weight scale has shape {tuple(scale.shape)}, expected {expected} "
                         f"for a {out}x{inp} weight in {block_out}x{block_in} blocks")
    return scale.repeat_interleave(block_out, dim=0)[:out].contiguous()
