"""Penalties that read a request's own tokens (repetition, frequency, presence), with
logit_bias and min_tokens, applied to a batch of logits rows at once on their device.

What a penalty reads, per row, is one int32 vector over the vocabulary: the token's count
among the outputs, plus PROMPT when it appears in the prompt (so "seen" is > 0 and the output
count is the low bits). Two sources fill it:
- `TokenStats`: kept on the device for running requests and updated there from each step's
  sampled tokens, so under overlap scheduling the token still in flight counts without the
  host knowing it (the host never waits for the GPU); tokens the host appended otherwise
  (jump-forward, speculative verdicts) are caught up from `token_ids` on the next use;
- `counts_from_lists`: from host token lists, for speculative verification's what-if rows.
"""
from __future__ import annotations

import torch

from engine.core.request import Request
from engine.executor.staging import take_rows, to_device

PROMPT = 1 << 24  # added once to a token's entry when the prompt holds it; outputs count below


def penalize(logits: torch.Tensor, reqs: list, counts: torch.Tensor | None,
             eos_token_ids: list[int]) -> torch.Tensor:
    """Edit `logits` [B, V] in place by each row's request (`params`, `output_ids`, and
    `inflight` when it has one): repetition (HF: every token seen, prompt included),
    frequency and presence (OpenAI: outputs only), logit_bias, and min_tokens (stop and EOS
    tokens barred while fewer outputs exist). `counts` [B, V] int32 as the module docstring
    says (None when no request reads counts: `SamplingParams.reads_token_counts`). No host
    sync."""
    dev, params = logits.device, [r.params for r in reqs]
    if any(p.repetition_penalty != 1.0 for p in params):
        rep = to_device([p.repetition_penalty for p in params], logits.dtype, dev).unsqueeze(1)
        logits = torch.where(counts > 0, torch.where(logits > 0, logits / rep, logits * rep), logits)
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        out = (counts & (PROMPT - 1)).to(logits.dtype)
        freq = to_device([p.frequency_penalty for p in params], logits.dtype, dev).unsqueeze(1)
        pres = to_device([p.presence_penalty for p in params], logits.dtype, dev).unsqueeze(1)
        logits = logits - (freq * out + pres * (out > 0))
    rows, ids, values = [], [], []
    for i, p in enumerate(params):
        bias = p.logit_bias or {}
        rows += [i] * len(bias)
        ids += list(bias)
        values += list(bias.values())
    if rows:
        logits = logits.index_put((to_device(rows, torch.long, dev), to_device(ids, torch.long, dev)),
                                  to_device(values, logits.dtype, dev), accumulate=True)
    rows, ids = [], []
    for i, (req, p) in enumerate(zip(reqs, params)):
        if len(req.output_ids) + getattr(req, "inflight", 0) < p.min_tokens:
            barred = p.stop_token_ids + ([] if p.ignore_eos else eos_token_ids)
            rows += [i] * len(barred)
            ids += barred
    if rows:
        logits = logits.index_put((to_device(rows, torch.long, dev), to_device(ids, torch.long, dev)),
                                  logits.new_full((len(rows),), float("-inf")))
    return logits


def counts_from_lists(reqs: list, vocab: int, device: torch.device) -> torch.Tensor:
    """[B, V] int32 from each row's `token_ids` (prompt + outputs) and `output_ids`."""
    rows, ids, weights = [], [], []
    for i, req in enumerate(reqs):
        prompt = req.token_ids[:len(req.token_ids) - len(req.output_ids)]
        unique = sorted(set(prompt))
        rows += [i] * (len(unique) + len(req.output_ids))
        ids += unique + list(req.output_ids)
        weights += [PROMPT] * len(unique) + [1] * len(req.output_ids)
    counts = torch.zeros((len(reqs), vocab), dtype=torch.int32, device=device)
    if rows:
        counts.index_put_((to_device(rows, torch.long, device), to_device(ids, torch.long, device)),
                          to_device(weights, torch.int32, device), accumulate=True)
    return counts


class TokenStats:
    """`counts` rows on the device for the running requests whose penalties read them
    (repetition, frequency, presence), one slot each (`Request.sampler_state` is not used:
    slots are by request id), freed when the scheduler releases the request. Requests with
    only logit_bias or min_tokens share row 0, which stays zero: a row is 4 bytes per
    vocabulary entry (512 KB at 128k), so they take none."""

    ZERO = 0

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.table = torch.zeros((1, vocab), dtype=torch.int32, device=device)
        self.slot: dict[str, int] = {}
        self.recorded: dict[str, int] = {}  # tokens of the request counted in its row
        self.free: list[int] = []

    def rows(self, reqs: list[Request]) -> torch.Tensor:
        """The requests' rows [B, V] (each brought up to its host-known tokens first)."""
        slots = [self._slot(req) for req in reqs]
        return self.table.index_select(0, to_device(slots, torch.long, self.device))

    def record(self, reqs: list[Request], tokens: torch.Tensor) -> None:
        """Count `tokens` [B] (on the device, sampled for `reqs`) as their outputs."""
        keep = [i for i, r in enumerate(reqs) if r.request_id in self.slot]
        if not keep:
            return
        slots = [self.slot[reqs[i].request_id] for i in keep]
        tokens = take_rows(tokens, keep)
        self.table.index_put_((to_device(slots, torch.long, self.device), tokens.long()),
                              torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
        for i in keep:
            self.recorded[reqs[i].request_id] += 1

    def release(self, req: Request) -> None:
        slot = self.slot.pop(req.request_id, None)
        if slot is not None:
            del self.recorded[req.request_id]
            self.free.append(slot)

    def _slot(self, req: Request) -> int:
        if not req.params.reads_token_counts:
            return self.ZERO
        rid = req.request_id
        if rid not in self.slot:
            if not self.free:
                self._grow()
            self.slot[rid] = slot = self.free.pop()
            self.table[slot].zero_()
            prompt = sorted(set(req.prompt_ids))
            if prompt:
                self.table[slot].index_put_((to_device(prompt, torch.long, self.device),),
                                            self.table.new_full((len(prompt),), PROMPT))
            self.recorded[rid] = len(req.prompt_ids)
        known = len(req.token_ids)
        if self.recorded[rid] < known:  # appended on the host without passing `record`
            missing = req.token_ids[self.recorded[rid]:known]
            self.table[self.slot[rid]].index_put_((to_device(missing, torch.long, self.device),),
                                                  torch.ones(len(missing), dtype=torch.int32,
                                                             device=self.device), accumulate=True)
            self.recorded[rid] = known
        return self.slot[rid]

    def _grow(self) -> None:
        old = self.table.shape[0]
        new = max(9, 2 * old - 1)  # row ZERO and a power of two of request rows
        grown = torch.zeros((new, self.vocab), dtype=torch.int32, device=self.device)
        grown[:old] = self.table
        self.table = grown
        self.free.extend(range(new - 1, old - 1, -1))
