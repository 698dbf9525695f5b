"""From a StepPlan to the step's packed integers (`StepInput`, engine/executor/step_input.py):
each chunk's new tokens, positions and KV slots; the req_to_token entries the step writes
first (each chunk's row from `Chunk.row_from` on, as the scheduler set it); which inputs
are still in flight (read on the device from the previous step's tokens); the token rows
whose logits come back; and, for decode, the radix-group metadata."""
from __future__ import annotations

from engine.executor.group_metadata import GroupMetadata
from engine.executor.step_input import PackedStep, PendingTokens, StepInput
from engine.core.step_plan import Chunk, StepPlan


def build_step(plan: StepPlan, prompt_rows: list[int], pending: PendingTokens | None,
               groups: GroupMetadata | None) -> PackedStep:
    if plan.is_decode:
        return _decode_step(plan.chunks, prompt_rows, pending, groups)
    return _extend_step(plan.chunks, prompt_rows, pending)


def _extend_step(chunks: list[Chunk], prompt_rows: list[int],
                 pending: PendingTokens | None) -> PackedStep:
    ids, positions, out_slots = [], [], []
    rows, seq_lens, extend_lens, logits_idx = [], [], [], []
    inflight_pos, inflight_src = [], []
    t = 0
    for chunk in chunks:
        req, start, n = chunk.req, chunk.start, chunk.num_tokens
        end = start + n
        known_end = min(end - len(chunk.draft), len(req.token_ids))
        ids += req.token_ids[start:known_end]
        for _ in range(known_end, end - len(chunk.draft)):  # a token still in flight
            inflight_pos.append(len(ids))
            inflight_src.append(pending.index[req])
            ids.append(0)  # overwritten on the device
        ids += chunk.draft
        positions += range(start, end)
        kv = req.kv
        out_slots += kv.slots[start:end]
        rows.append(kv.row)
        seq_lens.append(end)
        extend_lens.append(n)
        t += n
        if chunk.draft:  # speculative verification reads every position's logits
            logits_idx += range(t - n, t)
        else:
            logits_idx.append(t - 1)
    sync_rows, sync_cols, sync_slots = _row_writes(chunks, with_new=True)
    return StepInput(ids, positions, out_slots, rows, seq_lens, extend_lens,
                     _indptr(extend_lens), logits_idx, sync_rows, sync_cols, sync_slots,
                     prompt_rows, [], inflight_pos, inflight_src).pack(is_decode=False)


def _decode_step(chunks: list[Chunk], prompt_rows: list[int], pending: PendingTokens | None,
                 groups: GroupMetadata | None) -> PackedStep:
    """The common case, kept lean: one new token per request."""
    reqs = [c.req for c in chunks]
    ids = [r.token_ids[-1] for r in reqs]
    inflight_pos, inflight_src = [], []
    if pending is not None:  # overlap scheduling: inputs sampled by the in-flight step
        inflight_pos = [i for i, r in enumerate(reqs) if r.inflight]
        inflight_src = [pending.index[reqs[i]] for i in inflight_pos]
    kvs = [r.kv for r in reqs]
    seq_lens = [len(kv.slots) for kv in kvs]
    out_slots = [kv.slots[-1] for kv in kvs]
    positions = [s - 1 for s in seq_lens]
    rows = [kv.row for kv in kvs]
    sync_rows, sync_cols, sync_slots = rows, positions, out_slots  # each one newest slot
    stale = [c for c in chunks if c.row_from < c.start]
    if stale:  # rows touched since their last step (e.g. a prefix swapped for the tree's)
        old_rows, old_cols, old_slots = _row_writes(stale, with_new=False)
        sync_rows, sync_cols, sync_slots = (old_rows + rows, old_cols + positions,
                                            old_slots + out_slots)
    n = len(reqs)
    return StepInput(ids, positions, out_slots, rows, seq_lens, [1] * n, list(range(n + 1)),
                     list(range(n)), sync_rows, sync_cols, sync_slots, prompt_rows,
                     groups.packed(reqs, seq_lens) if groups is not None else [],
                     inflight_pos, inflight_src).pack(is_decode=True)


def _row_writes(chunks: list[Chunk], with_new: bool) -> tuple[list[int], list[int], list[int]]:
    """(rows, cols, slots): the req_to_token entries bringing each chunk's row from its
    `row_from` up to its start, or through its new tokens `with_new`."""
    rows, cols, slots = [], [], []
    for c in chunks:
        kv = c.req.kv
        end = c.start + c.num_tokens if with_new else c.start
        rows += [kv.row] * (end - c.row_from)
        cols += range(c.row_from, end)
        slots += kv.slots[c.row_from:end]
    return rows, cols, slots


def _indptr(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out
