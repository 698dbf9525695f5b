"""Mixed steps (decoders and prefill chunks in one batch) in the Triton attention backend,
checked without a GPU: the decoders through the decode kernel and the chunks through the
extend kernel, against the torch reference, via tests/test_triton_attention.py's mixed-step
cases under Triton's interpreter (kernels alone, and the engine against the torch backend on
steps where prompts join decoding requests); and the row count the runner hands the backend."""
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
    run_under_interpreter("test_triton_attention.py", select="mixed and not graph_replay")
    run_under_interpreter("test_triton_window.py", select="mixed_decoders")


def _launch_key(backend, batch: int, splits: int) -> tuple:
    """What sets a decode launch's binaries: DIRECT, the config, the reduce's BLOCK_S."""
    cfg = backend.pick_decode_cfg(backend.kv_heads * batch * splits, True)
    return splits == 1, tuple(sorted(cfg.items())), 1 << (splits - 1).bit_length() if splits > 1 else 0


@pytest.mark.parametrize("kv_fp8", [False, True])
def test_warmup_reaches_every_mixed_decode_launch(kv_fp8):
    """The start-up warm-up's mixed steps (engine/runtime/warmup.py) reach every decode launch a mixed
    step's decoders can make, for any decoder count and context length, so a fresh replica
    compiles nothing when its first mixed steps arrive (tests/test_cold_start.py checks the
    same on a GPU); and they cost the warm-up little (a handful of one-request waves)."""
    import types

    import torch

    from engine.kernels.attention.configs import TritonLaunchConfigs
    from engine.runtime.warmup import eager_decode_shapes

    backend = TritonLaunchConfigs()  # the launch heuristics alone, as on an H200 with 8B shapes
    backend.__dict__.update(decode_cfg=None, dot_dtype=torch.bfloat16, kv_fp8=kv_fp8, block_d=128,
                            smem_limit=227 * 1024, num_sms=132, kv_heads=8, max_kv_splits=32,
                            graph_mode=True, decode_split_min_tokens=128, force_num_splits=None)
    max_context, max_running = 16384, 1024
    engine = types.SimpleNamespace(
        runner=types.SimpleNamespace(attn_backend=backend, max_context=max_context,
                                     graphs=types.SimpleNamespace(max_bs=256)),
        config=types.SimpleNamespace(max_running_requests=max_running))
    shapes = eager_decode_shapes(engine, mixed=True)
    assert 1 <= len(shapes) <= 8 and all(bs == 1 for bs, _ in shapes)
    warmed = {_launch_key(backend, bs, backend.choose_num_splits(bs, n, eager=True))
              for bs, n in shapes}
    for decoders in list(range(1, 40)) + [63, 64, 65, 128, 131, 132, 133, 500, 1024]:
        for longest in (1, 2, 64, 128, 129, 200, 257, 1000, 2049, 4000, 8000, max_context - 8):
            splits = backend.choose_num_splits(decoders, longest, eager=True)
            assert _launch_key(backend, decoders, splits) in warmed, (decoders, longest, splits)


def test_attention_kernels_compile_for_hopper():
    """The interpreter runs the kernels' Python, not Triton's compiler (stricter about types
    across branches): compile the decode kernels (with the run-time `by_qo` rows
    of extend graphs) and the extend kernel (`skip_decoders`) for sm_90, bf16 pool, as a mixed
    step launches them (split or direct, with and without a sliding window)."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend")
    from triton_on_cpu import compile_for_sm90

    from engine.kernels.attention.decode import decode_partial_kernel, decode_reduce_kernel
    from engine.kernels.attention.extend import extend_kernel

    types = dict(Q="*bf16", K="*bf16", V="*bf16", Out="*bf16", KC="*bf16", VC="*bf16",
                 MidO="*fp32", MidLse="*fp32", PfxO="*fp32", PfxLse="*fp32", SeqLens="*i32",
                 ExtendLens="*i32", QoIndptr="*i32", sm_scale_log2="fp32")
    attn = dict(HEAD_DIM=128, BLOCK_D=128, F32_DOT=False, GROUP=4, BLOCK_N=64)
    for direct in (True, False):
        for window in (0, 512):
            compile_for_sm90(decode_partial_kernel, types,
                             dict(attn, BLOCK_H=16, DIRECT=direct, WINDOW=window))
    compile_for_sm90(decode_reduce_kernel, types, dict(BLOCK_N=64, HEAD_DIM=128, BLOCK_D=128,
                                                       BLOCK_S=4), num_warps=2)
    compile_for_sm90(extend_kernel, types, dict(attn, BLOCK_M=64))
