"""`argmax_rows` (engine/kernels/argmax.py): the two-launch argmax of a few rows of logits
gives exactly torch.argmax's index, ties to the lowest index included.

The `gpu` tests also run on the CPU under TRITON_INTERPRET=1 (the last test here), and the
kernels compile for sm_90 with PDL's wait before their first load.
"""
from __future__ import annotations

import pytest
import torch

from engine.kernels.argmax import BLOCK, argmax_rows
from test_triton_attention import DEVICE


def on_device(test):
    test = pytest.mark.gpu(test)
    return pytest.mark.skipif(DEVICE is None, reason="needs CUDA or TRITON_INTERPRET=1")(test)


def _logits(rows: int, vocab: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * 4).to(dtype)


@on_device
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("vocab", [1000, BLOCK, 3 * BLOCK + 5, 128256])
def test_matches_torch(rows, vocab):
    logits = _logits(rows, vocab, seed=rows * vocab).to(DEVICE)
    assert torch.equal(argmax_rows(logits, use_kernel=True).cpu(), logits.cpu().argmax(-1))


@on_device
def test_ties_go_to_the_lowest_index():
    vocab = 4 * BLOCK
    logits = _logits(4, vocab, seed=1)
    logits[0, [BLOCK + 7, 3 * BLOCK, 5]] = 100.0  # across blocks and inside the first
    logits[1, [BLOCK + 9, BLOCK + 3]] = 100.0  # inside one block
    logits[2] = float("-inf")  # a row the grammar masked entirely
    logits[3, [2 * BLOCK + 1]] = float("nan")  # a NaN wins, as in torch
    out = argmax_rows(logits.to(DEVICE), use_kernel=True).cpu()
    assert out.tolist() == [5, BLOCK + 3, 0, 2 * BLOCK + 1]
    assert torch.equal(out, logits.argmax(-1))


@on_device
def test_strided_logits():
    wide = _logits(3000, 2, seed=4).to(DEVICE).t()  # stride (1, 2): not row-contiguous
    assert torch.equal(argmax_rows(wide, use_kernel=True).cpu(), wide.cpu().argmax(-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter misreads bf16 loads")
def test_bf16_logits():
    logits = _logits(2, 5000, seed=3, dtype=torch.bfloat16).to("cuda")
    assert torch.equal(argmax_rows(logits, use_kernel=True).cpu(), logits.cpu().argmax(-1))


def test_cpu_logits_take_torch():
    logits = _logits(2, 300, seed=5)
    assert torch.equal(argmax_rows(logits), logits.argmax(-1))


def test_under_the_interpreter():
    pytest.importorskip("triton")
    from triton_on_cpu import run_under_interpreter

    run_under_interpreter("test_argmax.py", allow_skipped=True)  # bf16: GPU only


def test_compiles_for_hopper():
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend")
    from triton_on_cpu import compile_for_sm90

    from engine.kernels.argmax import _block_argmax_kernel, _row_argmax_kernel

    compile_for_sm90(_block_argmax_kernel, dict(X="*fp32", BestValue="*fp32", BestIndex="*i32", V="i32"),
                     dict(BLOCK=BLOCK))
    compile_for_sm90(_row_argmax_kernel, dict(BestValue="*fp32", BestIndex="*i32", Out="*i64"),
                     dict(BLOCKS=64))
