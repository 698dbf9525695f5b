"""Tiny FP8 checkpoints for tests: a tiny HF model's linear weights cast to float8 with scales,
in the compressed-tensors and HF FineGrainedFP8 formats, and the same weights dequantized
(the reference an FP8 load must equal)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.quantization.fp8 import FP8, FP8_MAX, to_fp8

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK = (16, 16)  # divides every width of the demo config (64, 128, 32)


def _quantize(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8 weight, checkpoint scale tensor, dequantized weight) for one [out, in] weight."""
    out, inp = w.shape
    if kind == "tensor":
        scale = (w.abs().max() / FP8_MAX).reshape(1)
        full = scale.expand(out, inp)
    elif kind == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
        full = scale.expand(out, inp)
    else:  # block
        b0, b1 = BLOCK
        blocks = w.reshape(out // b0, b0, inp // b1, b1)
        scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
        full = scale.repeat_interleave(b0, 0).repeat_interleave(b1, 1)
    q = to_fp8(w / full)
    return q, scale.float(), q.float() * full


def write_fp8_checkpoints(src: str, root: Path, fmt: str) -> tuple[str, str]:
    """fmt: "ct-tensor", "ct-channel", "ct-channel-weight-only" (compressed-tensors) or
    "fp8-block" (FineGrainedFP8). Returns (fp8 dir, dequantized fp32 dir)."""
    fp8_dir, deq_dir = root / f"{fmt}-fp8", root / f"{fmt}-deq"
    if fp8_dir.exists():
        return str(fp8_dir), str(deq_dir)
    kind = {"ct-tensor": "tensor", "ct-channel": "channel", "ct-channel-weight-only": "channel",
            "fp8-block": "block"}[fmt]
    for d in (fp8_dir, deq_dir):
        shutil.copytree(src, d, ignore=shutil.ignore_patterns("*.safetensors"))
    fp8_tensors, deq_tensors = {}, {}
    for path in sorted(Path(src).glob("*.safetensors")):
        for name, w in load_file(str(path)).items():
            if not any(f".{p}.weight" in name for p in LINEARS):
                fp8_tensors[name] = deq_tensors[name] = w
                continue
            q, scale, deq = _quantize(w.float(), kind)
            base = name[:-len(".weight")]
            fp8_tensors[name] = q
            fp8_tensors[base + (".weight_scale_inv" if kind == "block" else ".weight_scale")] = scale
            if fmt.startswith("ct-") and not fmt.endswith("weight-only"):
                fp8_tensors[base + ".input_scale"] = torch.ones(1)  # static scale: dropped on load
            deq_tensors[name] = deq
    save_file(fp8_tensors, str(fp8_dir / "model.safetensors"))
    save_file(deq_tensors, str(deq_dir / "model.safetensors"))
    set_quantization_config(fp8_dir, _quantization_config(fmt, kind))
    return str(fp8_dir), str(deq_dir)


def set_quantization_config(model_dir: Path, qc: dict | None) -> None:
    config_path = Path(model_dir) / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    if qc is not None:
        config["quantization_config"] = qc
    config_path.write_text(json.dumps(config))


def _quantization_config(fmt: str, kind: str) -> dict:
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
    activations = None if fmt.endswith("weight-only") else {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": activations,
                "weights": {"num_bits": 8, "type": "float", "strategy": kind, "dynamic": False,
                            "symmetric": True}}}}


assert FP8 is torch.float8_e4m3fn
