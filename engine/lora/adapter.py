"""LoRA adapters in PEFT's format, read and checked against the base model.

A PEFT adapter is a folder with `adapter_config.json` and `adapter_model.safetensors` (or
`adapter_model.bin`) holding, per adapted projection, `...layers.<i>.<block>.<proj>.lora_A.weight`
[r, in] and `...lora_B.weight` [out, r]. The delta of a projection is `x A^T B^T * scaling`
with PEFT's scaling: `lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`
(`rank_pattern` / `alpha_pattern` override r and alpha per module, matched as PEFT does).
The scaling is folded into B here, so the pool and the kernels never see it.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot serve on this model (the message names the tensor or field)."""


class LoRANotFoundError(LoRAError):
    """A request named an adapter that is not loaded (and not found where adapters load from)."""


@dataclass(frozen=True)
class TargetShape:
    """A projection an adapter may target: (in_features, out_features) of one layer's module."""

    in_features: int
    out_features: int


@dataclass
class LoRAAdapter:
    """Host copy of an adapter: (layer, module) -> (A [r, in], B * scaling [out, r])."""

    name: str
    path: str
    rank: int  # the largest rank of its modules
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def target_modules(self) -> set[str]:
        return {module for _, module in self.weights}


def load_adapter(name: str, path: str, shapes: dict[tuple[int, str], TargetShape],
                 max_rank: int) -> LoRAAdapter:
    """Read and check the adapter at `path`; LoRAError says what does not fit."""
    folder = Path(path).expanduser()
    config = _read_config(folder)
    tensors = _read_tensors(folder)
    pairs: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        layer, module, part = _place(key, shapes)
        pairs.setdefault((layer, module), {})[part] = (key, tensor)
    weights = {}
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            key = next(iter(ab.values()))[0]
            raise LoRAError(f"tensor {key!r}: its lora_{'B' if 'A' in ab else 'A'} pair is missing")
        weights[(layer, module)] = _checked_pair(ab, shapes[(layer, module)], config,
                                                 f"model.layers.{layer}.{_block(module)}.{module}",
                                                 max_rank)
    if not weights:
        raise LoRAError(f"adapter {name!r} at {path}: no LoRA weights found")
    rank = max(a.shape[0] for a, _ in weights.values())
    return LoRAAdapter(name, str(path), rank, weights)


def _block(module: str) -> str:
    return "self_attn" if module in MODULES[:4] else "mlp"


def _read_config(folder: Path) -> dict:
    file = folder / "adapter_config.json"
    if not file.is_file():
        raise LoRAError(f"{folder}: no adapter_config.json (not a PEFT adapter folder)")
    config = json.loads(file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{file}: peft_type {config['peft_type']!r} is not LORA")
    for field, bad in (("use_dora", bool(config.get("use_dora"))),
                       ("bias", config.get("bias", "none") != "none"),
                       ("modules_to_save", bool(config.get("modules_to_save")))):
        if bad:
            raise LoRAError(f"{file}: {field}={config[field]!r} is not supported")
    return config


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "adapter_model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(folder / "adapter_model.safetensors"))
    if (folder / "adapter_model.bin").is_file():
        return torch.load(folder / "adapter_model.bin", map_location="cpu", weights_only=True)
    raise LoRAError(f"{folder}: no adapter_model.safetensors or adapter_model.bin")


def _place(key: str, shapes: dict[tuple[int, str], TargetShape]) -> tuple[int, str, str]:
    m = _KEY.search(key)
    if m is None:
        raise LoRAError(f"tensor {key!r} is not a lora_A/lora_B weight of a decoder layer's "
                        f"projection ({', '.join(MODULES)})")
    layer, block, module, part = int(m[1]), m[2], m[3], m[4]
    if (layer, module) not in shapes or block != _block(module):
        raise LoRAError(f"tensor {key!r}: the base model has no {block}.{module} in layer {layer} "
                        "that adapters can target")
    return layer, module, part


def _checked_pair(ab: dict[str, tuple[str, torch.Tensor]], shape: TargetShape, config: dict,
                  module_name: str, max_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    (key_a, a), (key_b, b) = ab["A"], ab["B"]
    r = a.shape[0]
    if a.dim() != 2 or a.shape[1] != shape.in_features:
        raise LoRAError(f"tensor {key_a!r}: shape {tuple(a.shape)} does not fit the base model "
                        f"(expected [r, {shape.in_features}]): an adapter of another model?")
    if b.dim() != 2 or tuple(b.shape) != (shape.out_features, r):
        raise LoRAError(f"tensor {key_b!r}: shape {tuple(b.shape)} does not fit the base model "
                        f"(expected [{shape.out_features}, {r}]): an adapter of another model?")
    if r > max_rank:
        raise LoRAError(f"tensor {key_a!r}: rank {r} exceeds max_lora_rank={max_rank}")
    scaling = _scaling(config, module_name, r)
    return a.float().contiguous(), (b.float() * scaling).contiguous()


def _scaling(config: dict, module_name: str, tensor_rank: int) -> float:
    r = _pattern_value(config.get("rank_pattern") or {}, module_name, config.get("r", tensor_rank))
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module_name,
                           config.get("lora_alpha", r))
    if r != tensor_rank:
        raise LoRAError(f"{module_name}: adapter_config.json says r={r}, its tensors have "
                        f"rank {tensor_rank}")
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _pattern_value(patterns: dict, module_name: str, default):
    """PEFT's per-module override: the first pattern matching the module name's end."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module_name):
            return value
    return default
