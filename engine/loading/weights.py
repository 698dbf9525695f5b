"""Reading checkpoint weights (HF safetensors) and dummy random initialisation."""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.layers.norm import RMSNorm
from engine.layers.parallel import Loadable

logger = logging.getLogger(__name__)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's shard files: those named by the index when there is one (repos such as
    Mistral's also ship a `consolidated.safetensors` in another naming scheme), else all."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if len(files) > 1:
            files = [f for f in files if not f.name.startswith("consolidated")] or files
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir} (use load_format='dummy' "
                                "for random weights)")
    return files


def iterate_safetensors(model_dir: str | Path, lazy: bool = False) -> Iterator[tuple[str, Loadable]]:
    """(name, tensor) for every weight of every shard, on the CPU.

    With `lazy`, yields safetensors slices instead: indexing one reads only that part of the
    file, so a tensor-parallel rank never materialises the full tensor.
    """
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, (f.get_slice(name) if lazy else f.get_tensor(name))


def tensor_shapes(model: str) -> dict[str, tuple[int, ...]]:
    """Every safetensors tensor's shape, from the file headers (no tensor data is read)."""
    from engine.loading.model_source import resolve_model_path

    shapes = {}
    for path in safetensors_files(resolve_model_path(model)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes


def checkpoint_weights(model: str, hf_config, lazy: bool = False) -> Iterator[tuple[str, Loadable]]:
    """(name, tensor) for `model` in any format: a GGUF file (dequantized) or safetensors."""
    from engine.loading.model_source import resolve_model_path
    from engine.loading.gguf import is_gguf, iterate_gguf

    path = resolve_model_path(model)
    return iterate_gguf(path, hf_config) if is_gguf(path) else iterate_safetensors(path, lazy)


@torch.no_grad()
def dummy_init_(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Deterministic random weights without reading a checkpoint: N(0, std) everywhere,
    norm scales 1. Tied parameters are initialised once."""
    norm_params = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    generators: dict[torch.device, torch.Generator] = {}
    for _, param in model.named_parameters():  # deduplicated, in a fixed order
        if id(param) in norm_params:
            param.fill_(1.0)
            continue
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        param.normal_(0.0, std, generator=gen)
