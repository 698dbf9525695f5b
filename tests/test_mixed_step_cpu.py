"""Mixed steps (decoders and prefill chunks in one batch) in the Triton attention backend,
checked without a GPU: the decoders through the decode kernel and the chunks through the
extend kernel, against the torch reference, via tests/test_triton_attention.py's mixed-step
cases under Triton's interpreter; and the row count the runner hands the backend."""
from __future__ import annotations

import pytest
from triton_on_cpu import run_under_interpreter

from engine.attention.base import leading_decode_rows


def test_leading_decode_rows():
    assert leading_decode_rows([1, 1, 1, 300, 1]) == 3
    assert leading_decode_rows([70, 1, 1]) == 0
    assert leading_decode_rows([1, 1]) == 2
    assert leading_decode_rows([]) == 0


def test_mixed_steps_under_the_interpreter():
    pytest.importorskip("triton")
    run_under_interpreter("test_triton_attention.py", select="mixed")
