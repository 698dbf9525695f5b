"""StepInput packing: the fields travel as one int64 tensor (what rank 0 broadcasts at
tp > 1) and come back, field by field, on the receiving side."""
from __future__ import annotations

import torch

from engine.executor.step_input import FIELD_NAMES, PackedStep, StepInput


def test_pack_and_unpack_follow_the_fields():
    values = {name: list(range(i, 2 * i + 1)) for i, name in enumerate(FIELD_NAMES)}
    packed = StepInput(**values).pack(is_decode=True)
    assert packed.flat.dtype == torch.long and packed.lengths == [len(v) for v in values.values()]
    received = PackedStep.received(packed.flat.clone(), packed.lengths, is_decode=True)
    assert (received.seq_lens, received.extend_lens) == (values["seq_lens"], values["extend_lens"])
    assert received.host("prefix_groups").tolist() == values["prefix_groups"]
    unpacked = StepInput.unpack(received.flat, received.lengths)
    assert {name: getattr(unpacked, name).tolist() for name in FIELD_NAMES} == values
