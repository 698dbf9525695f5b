"""engine/executor/graph_runner.py's replay side on the CPU: which inputs each graph reads
from the one static batch the decode and extend graphs share, as steps of both kinds
alternate. A CUDA graph reads the tensors it was captured on at fixed addresses; here each
captured graph is a recorder that copies, at replay, the view its key was captured on
(the GPU tests replay real graphs: tests/test_gpu_engine.py and the others it names)."""
from __future__ import annotations

from itertools import accumulate
from types import SimpleNamespace

import pytest
import torch

from engine.attention.base import ForwardBatch
from engine.executor.graph_runner import GraphKey, GraphRunner
from engine.executor.prefix_group_batch import PrefixGroupBatch, packed_len

FIELDS = ("input_ids", "positions", "out_slots", "req_rows", "seq_lens", "extend_lens",
          "qo_indptr", "logits_indices")


def _runner(grouped: bool = False, extend=(128, 8)) -> tuple[GraphRunner, list]:
    """A runner of decode graphs up to 32 requests and extend graphs up to 8 requests and
    128 tokens whose graphs record what they read; the model's LM head passes hidden states
    through."""
    r2t = torch.zeros(65, 256, dtype=torch.int32)
    model = SimpleNamespace(compute_logits=lambda hidden: hidden.clone())
    runner = GraphRunner(model, None, r2t, 32, extend=extend, grouped=grouped)
    seen: list[tuple[GraphKey, dict]] = []
    for key in runner.keys(True) + runner.keys(False):
        if key.decode:
            view = runner.static.decode_view(key.bs, key.bs in runner.grouped_sizes)
        else:
            view = runner.static.extend_view(key.bs, key.tokens)
        runner.graphs[key] = SimpleNamespace(replay=_recorder(key, view, seen))
        runner.outputs[key] = torch.arange(key.tokens, dtype=torch.float32)[:, None] + key.bs
    return runner, seen


def _recorder(key: GraphKey, view: ForwardBatch, seen: list):
    def replay() -> None:
        read = {name: getattr(view, name).clone() for name in FIELDS}
        if view.prefix_groups is not None:
            read["groups"] = view.prefix_groups.packed.clone()
        seen.append((key, read))
    return replay


def _batch(lens: list[int], seq_lens: list[int], seed: int, is_decode: bool) -> ForwardBatch:
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    ints = lambda k: torch.randint(1, 1000, (k,), generator=g)
    qo = torch.tensor([0, *accumulate(lens)], dtype=torch.int32)
    return ForwardBatch(
        input_ids=ints(n), positions=ints(n), out_slots=ints(n), req_rows=ints(len(lens)),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        extend_lens=torch.tensor(lens, dtype=torch.int32), qo_indptr=qo,
        logits_indices=qo[1:].long() - 1, req_to_token=torch.zeros(1, 1, dtype=torch.int32),
        is_decode=is_decode, seq_lens_cpu=seq_lens, extend_lens_cpu=lens)


def _padded(t: torch.Tensor, size: int, fill: int) -> torch.Tensor:
    return torch.cat([t, t.new_full((size - t.numel(),), fill)])


def _check_extend(read: dict, batch: ForwardBatch, cap: int, tokens: int) -> None:
    """Padding tokens: id, position and slot 0; padding requests: no new tokens."""
    n = batch.num_tokens
    for name in ("input_ids", "positions", "out_slots"):
        assert torch.equal(read[name], _padded(getattr(batch, name), tokens, 0)), name
    for name in ("req_rows", "seq_lens", "extend_lens"):
        assert torch.equal(read[name], _padded(getattr(batch, name), cap, 0)), name
    assert torch.equal(read["qo_indptr"], _padded(batch.qo_indptr, cap + 1, n))
    assert read["logits_indices"].numel() == 0


def _check_decode(read: dict, batch: ForwardBatch, padded: int) -> None:
    """Padding rows: the dummy request (row 0, slot 0, length 1); extend_lens, qo_indptr and
    logits_indices the decode graph's constants, whatever extend steps wrote before."""
    for name in ("input_ids", "positions", "out_slots", "req_rows"):
        assert torch.equal(read[name], _padded(getattr(batch, name), padded, 0)), name
    assert torch.equal(read["seq_lens"], _padded(batch.seq_lens, padded, 1))
    assert torch.equal(read["extend_lens"], torch.ones(padded, dtype=torch.int32))
    assert torch.equal(read["qo_indptr"], torch.arange(padded + 1, dtype=torch.int32))
    assert torch.equal(read["logits_indices"], torch.arange(padded))


def test_decode_and_extend_steps_alternate_over_the_shared_buffers():
    runner, seen = _runner()
    mixed = _batch([1, 30, 9], [50, 70, 9], seed=1, is_decode=False)  # a decoder and two prompts
    assert runner.fits_extend(mixed) and not runner.fits_decode(mixed)
    hidden = runner.run_extend(mixed)
    assert seen[-1][0] == GraphKey(False, 4, 64)
    _check_extend(seen[-1][1], mixed, 4, 64)
    assert torch.equal(hidden, runner.outputs[GraphKey(False, 4, 64)][:40])

    decode = _batch([1] * 5, [7, 90, 33, 4, 61], seed=2, is_decode=True)
    assert runner.fits_decode(decode) and not runner.fits_extend(decode)
    logits = runner.run_decode(decode)
    assert seen[-1][0] == GraphKey(True, 8, 8)
    _check_decode(seen[-1][1], decode, 8)
    assert torch.equal(logits, runner.outputs[GraphKey(True, 8, 8)][:5])

    # the decode step's writes do not leak into the next extend's padding, nor back
    prompt = _batch([16], [16], seed=3, is_decode=False)
    runner.run_extend(prompt)
    assert seen[-1][0] == GraphKey(False, 1, 16)
    _check_extend(seen[-1][1], prompt, 1, 16)
    wide = _batch([1] * 32, list(range(2, 34)), seed=4, is_decode=True)
    runner.run_decode(wide)
    _check_decode(seen[-1][1], wide, 32)
    many = _batch([2] * 8, [40] * 8, seed=5, is_decode=False)  # 8 requests: bucket >= 8
    runner.run_extend(many)
    _check_extend(seen[-1][1], many, 8, 16)
    small = _batch([1] * 3, [9, 8, 7], seed=6, is_decode=True)  # pads over `many`'s rows
    runner.run_decode(small)
    assert seen[-1][0] == GraphKey(True, 4, 4)
    _check_decode(seen[-1][1], small, 4)
    short = _batch([10, 5, 5], [10, 25, 5], seed=7, is_decode=False)  # pads over `wide`'s
    runner.run_extend(short)
    assert seen[-1][0] == GraphKey(False, 4, 32)
    _check_extend(seen[-1][1], short, 4, 32)
    assert (runner.decode_replays, runner.extend_replays) == (3, 4)


def test_limits_of_each_kind():
    runner, _ = _runner()
    assert (runner.max_bs, runner.max_extend_bs, runner.max_extend_tokens) == (32, 8, 128)
    assert not runner.fits_decode(_batch([1] * 33, [5] * 33, seed=1, is_decode=True))
    assert not runner.fits_extend(_batch([129], [129], seed=1, is_decode=False))
    assert not runner.fits_extend(_batch([2] * 9, [4] * 9, seed=1, is_decode=False))
    assert runner.fits_extend(_batch([64, 64], [64, 70], seed=1, is_decode=False))
    # the buffers hold the most tokens and requests of either kind
    assert runner.static.input_ids.numel() == 128 and runner.static.req_rows.numel() == 32
    for extend in (None, (8, 4)):  # none asked for, or no token bucket fits
        plain, _ = _runner(extend=extend)
        assert plain.keys(False) == [] and plain.max_extend_tokens == 0
        assert not plain.fits_extend(_batch([3], [3], seed=1, is_decode=False))


def test_grouped_decode_metadata_is_written_then_cleared():
    runner, seen = _runner(grouped=True)
    assert runner.grouped_sizes == {16, 32}
    assert (runner.grouped_capacity(10), runner.grouped_capacity(5),
            runner.grouped_capacity(33)) == (16, None, None)
    packed = torch.arange(packed_len(16)) + 3
    step = _batch([1] * 10, [20] * 10, seed=6, is_decode=True)
    step.prefix_groups = PrefixGroupBatch(packed=packed, cap=16, num_tiles=2, num_splits=1,
                                          max_suffix=4)
    runner.run_decode(step)
    assert seen[-1][0] == GraphKey(True, 16, 16)
    assert torch.equal(seen[-1][1]["groups"], packed)
    runner.run_extend(_batch([20], [20], seed=7, is_decode=False))  # an extend leaves them
    runner.run_decode(_batch([1] * 12, [20] * 12, seed=8, is_decode=True))  # no groups
    empty = torch.zeros(packed_len(16), dtype=torch.long)
    empty[1] = 1  # no tiles, one split
    assert torch.equal(seen[-1][1]["groups"], empty)
    step.prefix_groups = PrefixGroupBatch(packed=packed, cap=32, num_tiles=2, num_splits=1,
                                          max_suffix=4)
    with pytest.raises(AssertionError, match="another capacity"):
        runner.run_decode(step)


def test_each_capture_forward_runs_the_model_on_its_dummy_inputs(tiny_llama, monkeypatch):
    """What the capture runs for every key (its dummy inputs written, then the forward up to
    the hidden states) through the real model, eagerly on the CPU (torch attention): decode
    graphs first, then extend graphs, one output row per token of the key."""
    from engine import LLM
    from engine.executor import graph_capture, graph_runner

    runner = LLM(model=tiny_llama, device="cpu", dtype="float32", max_total_tokens=512).engine.runner
    order = []

    @torch.inference_mode()
    def capture_eagerly(keys, run, pool=None, prepare=None, warmups=2):
        outputs = {}
        for key in keys:
            prepare(key)
            outputs[key] = run(key).clone()
            order.append(key)
        return graph_capture.Captured(dict.fromkeys(keys), outputs, "pool", {})

    monkeypatch.setattr(graph_runner, "capture_graphs", capture_eagerly)
    monkeypatch.setattr(graph_runner, "compile_decode_inputs", lambda *args: None)
    graphs = GraphRunner(runner.model, runner.attn_backend, runner.req_to_token, 8,
                         extend=(32, 4))
    graphs.capture()
    assert order == graphs.keys(True) + graphs.keys(False) and len(order) == 4 + 6
    hidden = runner.hf_config.hidden_size
    for key, out in graphs.outputs.items():
        assert out.shape == (key.tokens, hidden) and torch.isfinite(out).all(), key
