"""`write_decode_inputs` (engine/executor/graph_inputs.py): one launch writes a packed decode step
into the decode graph's static inputs exactly as the unpacked path does (the fields, the
dummy rows up to the padded size, req_to_token's entries, the in-flight tokens).

The `gpu` tests also run on the CPU under TRITON_INTERPRET=1 (the last tests here); the
engine's decode graphs take this path on the GPU in tests/test_gpu_engine.py.
"""
from __future__ import annotations

import pytest
import torch

from engine.executor.graph_inputs import takes_packed, write_decode_inputs
from engine.executor.step_input import StepInput
from test_triton_attention import DEVICE


def on_device(test):
    test = pytest.mark.gpu(test)
    return pytest.mark.skipif(DEVICE is None, reason="needs CUDA or TRITON_INTERPRET=1")(test)


def _step(bs: int, inflight: list[int], seed: int) -> StepInput:
    g = torch.Generator().manual_seed(seed)
    ints = lambda n, hi: torch.randint(0, hi, (n,), generator=g).tolist()  # noqa: E731
    rows = torch.randperm(512, generator=g)[:bs].tolist()
    seq_lens = [x + 1 for x in ints(bs, 60)]
    return StepInput(
        input_ids=[0 if i in inflight else t for i, t in enumerate(ints(bs, 30000))],
        positions=[n - 1 for n in seq_lens], out_slots=ints(bs, 5000), req_rows=rows,
        seq_lens=seq_lens, extend_lens=[1] * bs, qo_indptr=list(range(bs + 1)),
        logits_indices=list(range(bs)), sync_rows=rows, sync_cols=[n - 1 for n in seq_lens],
        sync_slots=ints(bs, 5000), prompt_rows=[], prefix_groups=[],
        inflight_pos=inflight, inflight_src=list(reversed(range(len(inflight)))))


def _reference(step: StepInput, pending: torch.Tensor, r2t: torch.Tensor, padded: int):
    """What the unpacked path leaves in the static inputs (model_runner._make_batch, then
    GraphRunner.run_decode's copies and dummy rows)."""
    bs = len(step.input_ids)
    pad = padded - bs
    ids = torch.tensor(step.input_ids)
    ids[step.inflight_pos] = pending[step.inflight_src]
    r2t = r2t.clone()
    r2t[step.sync_rows, step.sync_cols] = torch.tensor(step.sync_slots, dtype=torch.int32)
    return {"input_ids": torch.cat([ids, torch.zeros(pad, dtype=torch.long)]),
            "positions": torch.tensor(step.positions + [0] * pad),
            "out_slots": torch.tensor(step.out_slots + [0] * pad),
            "req_rows": torch.tensor(step.req_rows + [0] * pad),
            "seq_lens": torch.tensor(step.seq_lens + [1] * pad, dtype=torch.int32)}, r2t


@on_device
@pytest.mark.parametrize("bs,padded,inflight", [(1, 1, [0]), (1, 1, []), (3, 4, [0, 2]),
                                                (13, 16, list(range(13))), (300, 320, [5, 299])])
def test_matches_the_unpacked_path(bs, padded, inflight):
    step = _step(bs, inflight, seed=bs)
    packed = step.pack(is_decode=True)
    assert takes_packed(packed.lengths)
    pending = torch.arange(100, 100 + max(len(inflight), 1))
    r2t = torch.randint(0, 9, (512, 64), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    statics = {"input_ids": torch.full((512,), -7), "positions": torch.full((512,), -7),
               "out_slots": torch.full((512,), -7), "req_rows": torch.full((512,), -7),
               "seq_lens": torch.full((512,), -7, dtype=torch.int32)}
    statics = {k: v.to(DEVICE) for k, v in statics.items()}
    r2t_dev = r2t.to(DEVICE)
    write_decode_inputs(packed.flat.to(DEVICE), packed.lengths, pending.to(DEVICE), r2t_dev,
                        statics, padded)
    want, want_r2t = _reference(step, pending, r2t, padded)
    for name, value in want.items():
        got = statics[name].cpu()
        assert torch.equal(got[:padded], value), name
        assert (got[padded:] == -7).all(), f"{name}: written past the padded size"
    assert torch.equal(r2t_dev.cpu(), want_r2t)


@on_device
@pytest.mark.parametrize("padded", [1, 48])
def test_capture_time_call_writes_only_dummy_rows(padded):
    """compile_decode_inputs (run once per graph size at capture) leaves the static inputs
    as a padded size of dummy rows and req_to_token untouched."""
    from engine.executor.graph_inputs import compile_decode_inputs

    r2t = torch.randint(0, 9, (64, 16), generator=torch.Generator().manual_seed(2),
                        dtype=torch.int32).to(DEVICE)
    before = r2t.clone()
    statics = {name: torch.full((64,), -7, dtype=torch.int32 if name == "seq_lens" else torch.long,
                                device=DEVICE)
               for name in ("input_ids", "positions", "out_slots", "req_rows", "seq_lens")}
    compile_decode_inputs(padded, r2t, statics)
    for name, value in statics.items():
        assert (value[:padded].cpu() == (1 if name == "seq_lens" else 0)).all(), name
        assert (value[padded:].cpu() == -7).all(), name
    assert torch.equal(r2t, before)


def test_steps_with_prompt_rows_or_groups_stay_unpacked():
    step = _step(2, [], seed=3)
    assert takes_packed(step.pack(True).lengths)
    step.prompt_rows = [0]
    assert not takes_packed(step.pack(True).lengths)
    step.prompt_rows, step.prefix_groups = [], [1, 2, 3]
    assert not takes_packed(step.pack(True).lengths)


def test_under_the_interpreter():
    pytest.importorskip("triton")
    from triton_on_cpu import run_under_interpreter

    run_under_interpreter("test_graph_inputs.py", select="not capture_compiles")


def test_compiles_for_hopper():
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend")
    from triton_on_cpu import compile_for_sm90

    from engine.executor.graph_inputs import _decode_inputs_kernel

    compile_for_sm90(_decode_inputs_kernel, dict(ReqToToken="*i32", SeqLens="*i32"), dict(BLOCK=16))


def test_step_sizes_do_not_select_binaries():
    """Sizes and offsets that change every step must not pick a new specialization (a
    compile on a fresh replica in the middle of serving); only the graph's padded size and
    req_to_token's stride, fixed per captured graph, may."""
    pytest.importorskip("triton")
    from engine.executor.graph_inputs import _decode_inputs_kernel

    params = _decode_inputs_kernel.params
    scalars = {p.name for p in params if not p.is_constexpr and p.name[0].islower()}
    loose = {p.name for p in params if p.do_not_specialize}
    assert loose == scalars - {"padded", "stride_r2t"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiles)")
def test_graph_capture_compiles_the_writer_for_every_size(tiny_llama):
    """The writer runs outside the graphs, once per padded size: capture compiles it for
    each (with the warm-up off, so nothing else does), and decode batches of every size
    compile nothing. Without it, a W1 run compiled it at four batch sizes mid-run."""
    import triton

    from engine import LLM, SamplingParams

    llm = LLM(model=tiny_llama, dtype="float32", device="cuda", max_total_tokens=8192,
              cuda_graph_max_bs=64, enable_warmup=False)
    compiled = []
    old = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["repr"])
    try:
        for bs in (3, 20, 40, 60):
            llm.generate([[5 + i, 6, 7] for i in range(bs)],
                         SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    finally:
        triton.knobs.runtime.jit_post_compile_hook = old
    assert not [c for c in compiled if "_decode_inputs_kernel" in c], compiled
