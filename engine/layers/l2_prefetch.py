"""Weights pulled into L2 while the memory bus would idle (Hopper; an experiment, off by default).

A batch-1 decode step reads every weight once, and its floor is those bytes at the copy
rate. Between a layer's GEMVs run kernels that read almost nothing (RoPE, attention over
one token's context, its reduce, the RMSNorms): about 10 us a layer on the H200, in which
the bus carries nearly nothing, while each small GEMV after them pays ~3 us of ramp before
its reads flow (qkv and o run at 57-75% of the copy rate on the H200). `prefetch_l2` asks
the copy engine of the SM (`cp.async.bulk.prefetch.L2`, one instruction per chunk) to
bring a weight's first bytes into L2 and returns at once; the GEMV that comes later reads
them from L2.

Which weights and how much (`RADIXSERVE_L2_PREFETCH`, a comma-separated list of
`target:megabytes`; unset or "0": off), each asked for at the start of the stretch of small
kernels before its GEMV: `qkv` at the layer's start (during its RMSNorm), `o` right after
qkv (during RoPE, attention and its reduce), `gate_up` after o (during the second RMSNorm).
A GEMV's first programs read its weight's first bytes, so a budget smaller than the weight
still takes its ramp away. Only steps of at most `MAX_ROWS` tokens prefetch: above that the
linears are GEMMs that reuse each weight tile across rows. Not yet measured on a GPU:
`scripts/bench_l2_prefetch.py` (the kernel alone) and the W3 step with and without it
decide whether it stays.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.kernels.pdl import pdl_launch, pdl_prologue

MAX_ROWS = 16
CHUNK_BYTES = 16 << 10  # one bulk prefetch; 16-byte multiples, as the instruction requires
CHUNKS_PER_PROGRAM = 128
TARGET_NAMES = ("qkv", "o", "gate_up")


def parse_targets(setting: str | None) -> dict[str, int]:
    """`RADIXSERVE_L2_PREFETCH`'s value -> {target: bytes}; {} when unset or "0"."""
    if not setting or setting.strip() == "0":
        return {}
    targets = {}
    for item in setting.split(","):
        name, _, megabytes = item.strip().partition(":")
        if name not in TARGET_NAMES or not megabytes:
            raise ValueError(f"RADIXSERVE_L2_PREFETCH: {item!r} is not TARGET:MB with a "
                             f"target of {', '.join(TARGET_NAMES)}")
        targets[name] = int(float(megabytes) * (1 << 20))
    return targets


TARGETS = parse_targets(os.environ.get("RADIXSERVE_L2_PREFETCH"))


@triton.jit
def prefetch_chunks(W, nbytes, program, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr):
    """Chunks program * PER_PROGRAM.. of W's first `nbytes` into L2, one bulk prefetch each
    (a helper other kernels may call too; the copies finish on their own)."""
    offsets = (program * PER_PROGRAM + tl.arange(0, PER_PROGRAM)).to(tl.int64) * CHUNK
    inside = offsets < nbytes
    # Lanes past the end repeat the first chunk's first 16 bytes instead of branching:
    # the instruction takes no predicate from Triton, and a repeat costs nothing.
    offsets = tl.where(inside, offsets, 0)
    size = tl.where(inside, tl.minimum(nbytes - offsets, CHUNK), 16).to(tl.int32)
    address = (W + offsets).to(tl.int64)
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
        "=r,l,r", [address, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_kernel(W, nbytes, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr,
                     PDL: tl.constexpr):
    # Waits like every kernel under PDL (the chain's order stays a plain stream's), though
    # the bytes it asks for are weights nothing writes.
    pdl_prologue(PDL)
    prefetch_chunks(W, nbytes, tl.program_id(0), CHUNK, PER_PROGRAM)


def can_prefetch(weight: torch.Tensor) -> bool:
    """Only on Hopper or later with a real launch (not the interpreter)."""
    return (weight.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(weight.device)[0] >= 9)


def prefetch_l2(weight: torch.Tensor, nbytes: int) -> None:
    """Ask L2 for the first `nbytes` of `weight` (all of it if smaller) and return; the
    copies finish on their own. A no-op where `can_prefetch` says no."""
    if not can_prefetch(weight):
        return
    nbytes = min(nbytes, weight.numel() * weight.element_size()) // 16 * 16
    chunks = triton.cdiv(nbytes, CHUNK_BYTES)
    if chunks == 0:
        return
    grid = (triton.cdiv(chunks, CHUNKS_PER_PROGRAM),)
    _prefetch_kernel[grid](weight.reshape(-1).view(torch.uint8), nbytes, CHUNK=CHUNK_BYTES,
                           PER_PROGRAM=CHUNKS_PER_PROGRAM,
                           num_warps=4, **pdl_launch(weight.device))


def prefetch_for(target: str, linear: torch.nn.Module, rows: int) -> None:
    """The model's hook: prefetch `linear`'s weight when `target` is switched on and the step
    has at most MAX_ROWS tokens."""
    nbytes = TARGETS.get(target)
    if nbytes and rows <= MAX_ROWS:
        prefetch_l2(linear.weight, nbytes)
