"""A packed decode step written into the decode graph's static inputs in one launch.

Unpacked field by field, a decode step costs a dozen small launches before its graph
replays: req_to_token's new entries, the in-flight tokens' gather and scatter, int32
casts, then one copy per static input (~50 us a step at batch 1 on the H200, more than
its argmax; bench_offline.py --profile-w3). Here one program reads the uploaded step
(engine/executor/step_input.py's layout) and writes the padded static inputs, req_to_token's
entries and the in-flight tokens itself.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import pdl_launch, pdl_prologue
from engine.executor.step_input import FIELD_NAMES, StepInput


# Every size and offset changes from step to step: specializing on them (== 1, divisible
# by 16) compiled a new binary for steps no graph capture or warm-up had seen (21 in one W1
# run, seconds each on a fresh replica).
STEP_SCALARS = ["bs", "o_ids", "o_pos", "o_slots", "o_rows", "o_lens", "o_sync", "n_sync",
                "o_inflight", "n_inflight"]


@triton.jit(do_not_specialize=STEP_SCALARS)
def _decode_inputs_kernel(Flat, Pending, ReqToToken, InputIds, Positions, OutSlots, ReqRows,
                          SeqLens, bs, padded, o_ids, o_pos, o_slots, o_rows, o_lens, o_sync,
                          n_sync, o_inflight, n_inflight, stride_r2t, BLOCK: tl.constexpr,
                          PDL: tl.constexpr = False):
    pdl_prologue(PDL)
    i = tl.arange(0, BLOCK)
    real, keep = i < bs, i < padded
    # rows past bs are the graph's dummy request: row 0, slot 0, one token
    tl.store(InputIds + i, tl.load(Flat + o_ids + i, mask=real, other=0), mask=keep)
    tl.store(Positions + i, tl.load(Flat + o_pos + i, mask=real, other=0), mask=keep)
    tl.store(OutSlots + i, tl.load(Flat + o_slots + i, mask=real, other=0), mask=keep)
    tl.store(ReqRows + i, tl.load(Flat + o_rows + i, mask=real, other=0), mask=keep)
    tl.store(SeqLens + i, tl.load(Flat + o_lens + i, mask=real, other=1).to(tl.int32), mask=keep)
    for start in range(0, n_sync, BLOCK):  # sync_rows, sync_cols, sync_slots back to back
        j = start + i
        m = j < n_sync
        row = tl.load(Flat + o_sync + j, mask=m, other=0)
        col = tl.load(Flat + o_sync + n_sync + j, mask=m, other=0)
        slot = tl.load(Flat + o_sync + 2 * n_sync + j, mask=m, other=0)
        tl.store(ReqToToken + row * stride_r2t + col, slot.to(tl.int32), mask=m)
    # the in-flight tokens replace their rows' placeholders: after the barrier, so that
    # these stores land after the plain ones above (other threads of this program)
    tl.debug_barrier()
    for start in range(0, n_inflight, BLOCK):  # inflight_pos, inflight_src back to back
        j = start + i
        m = j < n_inflight
        pos = tl.load(Flat + o_inflight + j, mask=m, other=0)
        src = tl.load(Flat + o_inflight + n_inflight + j, mask=m, other=0)
        tl.store(InputIds + pos, tl.load(Pending + src, mask=m, other=0), mask=m)


def field_offsets(lengths: list[int]) -> dict[str, int]:
    """Where each StepInput field starts in a packed step."""
    offsets, at = {}, 0
    for name, n in zip(FIELD_NAMES, lengths):
        offsets[name] = at
        at += n
    return offsets


def takes_packed(lengths: list[int]) -> bool:
    """Whether a decode step's fields are all ones the kernel writes: no prompt rows to
    score and no radix-grouped decode metadata (those go through the unpacked path)."""
    n = dict(zip(FIELD_NAMES, lengths))
    return n["prompt_rows"] == 0 and n["prefix_groups"] == 0


def write_decode_inputs(flat: torch.Tensor, lengths: list[int], pending: torch.Tensor | None,
                        req_to_token: torch.Tensor, statics: dict[str, torch.Tensor],
                        padded: int) -> None:
    """Write the uploaded decode step `flat` (int64, on the device) into `statics` (the
    graph's input_ids, positions, out_slots, req_rows, seq_lens) padded to `padded` rows,
    its req_to_token entries into `req_to_token`, and its in-flight tokens from `pending`."""
    n = dict(zip(FIELD_NAMES, lengths))
    at = field_offsets(lengths)
    bs = n["input_ids"]
    _decode_inputs_kernel[(1,)](
        flat, pending if pending is not None else flat, req_to_token, statics["input_ids"],
        statics["positions"], statics["out_slots"], statics["req_rows"], statics["seq_lens"],
        bs, padded, at["input_ids"], at["positions"], at["out_slots"], at["req_rows"],
        at["seq_lens"], at["sync_rows"], n["sync_rows"], at["inflight_pos"], n["inflight_pos"],
        req_to_token.stride(0), BLOCK=triton.next_power_of_2(padded), **pdl_launch(flat.device))


def compile_decode_inputs(padded: int, req_to_token: torch.Tensor,
                          statics: dict[str, torch.Tensor]) -> None:
    """Compile the kernel for a graph's padded size at capture, as the graph's own kernels
    are: it runs outside the graph, and a size first met in serving would compile then.
    Writes a dummy step of `padded` rows (no req_to_token entries), which the first real
    step overwrites."""
    n = padded
    step = StepInput([0] * n, [0] * n, [0] * n, [0] * n, [1] * n, [1] * n, list(range(n + 1)),
                     list(range(n)), [], [], [], [], [], [], []).pack(is_decode=True)
    write_decode_inputs(step.flat.to(req_to_token.device), step.lengths, None, req_to_token,
                        statics, padded)
