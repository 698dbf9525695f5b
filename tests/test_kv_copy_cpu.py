"""The host tier's copy kernel checked without a GPU: tests/test_kv_copy.py's kernel tests
through Triton's interpreter, and the kernel compiled for sm_90."""
from __future__ import annotations

import pytest
from triton_on_cpu import compile_for_sm90, run_under_interpreter


def test_kv_copy_under_the_interpreter():
    pytest.importorskip("triton")
    run_under_interpreter("test_kv_copy.py", allow_skipped=True, select="not engine")


def test_kv_copy_compiles_for_hopper():
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend")
    from engine.kernels.kv_copy import _copy_rows_kernel

    compile_for_sm90(_copy_rows_kernel, dict(Src="*i32", Dst="*i32", SrcIdx="*i64",
                                             DstIdx="*i64"), dict(BLOCK=512))
