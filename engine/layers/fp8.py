"""Turning a model's linear layers into FP8 ones (see engine/quantization/fp8.py for the math).

Two ways in: `quantize_linears_` quantizes weights already loaded in bf16/fp32 (on-the-fly,
`EngineConfig(quantization="fp8")`); `make_fp8_linears_` gives the layers empty float8
weights and scales before a pre-quantized checkpoint is copied into them. Embeddings, the
LM head and norms stay in the model dtype (they are not GEMMs over the hidden state, or,
for the LM head, too sensitive for the little they would save at batch 1).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.layers.linear import LinearBase, RowParallelLinear
from engine.layers.parallel import Loadable, copy_into, materialize, narrow
from engine.quantization.fp8 import FP8, FP8_LINEAR, quantize_rows


def linear_layers(model: nn.Module) -> list[LinearBase]:
    return [m for m in model.modules() if isinstance(m, LinearBase)]


@torch.no_grad()
def quantize_linears_(model: nn.Module) -> None:
    """Loaded weights -> float8 with one scale per output channel (row): every linear layer
    but those marked `keep_dtype` (MoE routers: a token's experts hang on small logit gaps),
    and the stacked experts of MoE layers (`FusedMoE.quantize_fp8_`)."""
    from engine.layers.moe import FusedMoE

    for layer in linear_layers(model):
        if layer.keep_dtype:
            continue
        weight, scale = quantize_rows(layer.weight.data)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        layer.quant_method = FP8_LINEAR
    for experts in (m for m in model.modules() if isinstance(m, FusedMoE)):
        experts.quantize_fp8_()


def set_fast_accum_(model: nn.Module, on: bool) -> None:
    """Whether the FP8 layers' `torch._scaled_mm` accumulates in the tensor cores' own
    precision (`EngineConfig.fp8_fast_accum`); decode-sized batches take the weight-only
    kernel, which this does not touch."""
    for layer in linear_layers(model):
        layer.fast_accum = on


def make_fp8_linears_(model: nn.Module, block_in: int | None, quantize_input: bool) -> None:
    """Empty float8 weights and float32 scales [out, G] to load a checkpoint into; G =
    in_features / block_in for block-scaled checkpoints, else 1."""
    for layer in linear_layers(model):
        out_local, in_local = layer.weight.shape
        if block_in is not None and in_local % block_in:
            raise ValueError(f"FP8 block size {block_in} does not divide a layer's input width "
                             f"{in_local} (on this tensor-parallel rank)")
        groups = in_local // block_in if block_in else 1
        device = layer.weight.device
        weight = nn.Parameter(torch.empty(out_local, in_local, dtype=FP8, device=device),
                              requires_grad=False)
        weight.weight_loader = _float8_only(layer.weight_loader)
        scale = nn.Parameter(torch.empty(out_local, groups, dtype=torch.float32, device=device),
                             requires_grad=False)
        scale.weight_loader = (_row_parallel_scale_loader(layer) if isinstance(layer, RowParallelLinear)
                               else layer.weight_loader)
        layer.weight, layer.weight_scale = weight, scale
        layer.quant_method = FP8_LINEAR
        layer.quantize_input = quantize_input


def _float8_only(loader):
    """A weight loader that refuses anything but float8: copying bf16 into a float8 parameter
    would be a silent lossy cast (e.g. a layer the checkpoint left unquantized)."""
    def load(param: nn.Parameter, loaded: Loadable, *shard) -> None:
        if loaded_dtype(loaded) != "F8_E4M3":
            raise ValueError(f"FP8 checkpoint holds an unquantized ({loaded_dtype(loaded)}) linear "
                             "weight; mixed-precision FP8 checkpoints are not supported")
        loader(param, loaded, *shard)
    return load


def _row_parallel_scale_loader(layer: RowParallelLinear):
    """Row-parallel layers split the input features: per-channel scales [out, 1] are whole on
    every rank; block scales [out, G] split along G like the weight's columns."""
    def load(param: nn.Parameter, loaded: Loadable) -> None:
        loaded = materialize(loaded)
        groups = param.shape[1]
        if loaded.shape[1] != groups:
            loaded = narrow(loaded, 1, layer.tp.rank * groups, groups)
        copy_into(param, loaded)
    return load


def loaded_dtype(loaded: Loadable) -> str:
    """The safetensors dtype name ("F8_E4M3", "BF16", ...) of a tensor or a lazy slice."""
    if not isinstance(loaded, torch.Tensor):
        return loaded.get_dtype()
    return _SAFETENSORS_NAMES.get(loaded.dtype, str(loaded.dtype))


_SAFETENSORS_NAMES = {FP8: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.bfloat16: "BF16",
                      torch.float16: "F16", torch.float32: "F32"}
