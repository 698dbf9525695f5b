"""Token selection on the model's device: penalties, temperature, top-k/top-p/min-p,
per-request seeds, and log-probabilities of the chosen and the top tokens."""
from __future__ import annotations

from dataclasses import dataclass
import os

import torch

from engine.kernels.argmax import argmax_rows
from engine.core.request import Request
from engine.executor.penalties import TokenStats, counts_from_lists, penalize
from engine.executor.staging import take_rows, to_device

# Top-k / top-p / min-p by the sort-free cut (engine/kernels/sampling_cut.py) on GPUs; by
# sorting elsewhere. RADIXSERVE_SORT_FREE_CUT=0 sorts on GPUs too (A/B runs).
SORT_FREE_CUT = os.environ.get("RADIXSERVE_SORT_FREE_CUT", "1") != "0"


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float] | None  # of each chosen token, when any request asked
    top_logprobs: list[list[tuple[int, float]]] | None


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, eos_token_ids=()) -> None:
        self.device = device
        self.eos_token_ids = sorted(eos_token_ids)  # barred before a request's min_tokens
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.stats: TokenStats | None = None  # token counts of running requests with penalties

    def sample(self, logits: torch.Tensor, reqs: list[Request],
               masks: torch.Tensor | None = None) -> SampleOutput:
        """logits: [B, V] float32, one row per request. `masks`: optional [B, V] bool of
        allowed tokens (structured output)."""
        params = [r.params for r in reqs]
        want_logprobs = any(p.logprobs or p.top_logprobs for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        tokens = self.sample_tokens(logits, reqs, masks)
        token_list = tokens.tolist()
        if raw_logprobs is None:
            return SampleOutput(token_list, None, None)
        return SampleOutput(token_list, *self.gather_logprobs(raw_logprobs, tokens, params))

    def sample_tokens(self, logits: torch.Tensor, reqs: list[Request],
                      masks: torch.Tensor | None = None) -> torch.Tensor:
        """The chosen token ids [B], left on the device (no host sync). Requests with
        penalties read their tokens' counts kept on the device (engine/executor/penalties.py), so they
        need no host sync either; the tokens chosen here are counted as their outputs."""
        params = [r.params for r in reqs]
        rows = [i for i, p in enumerate(params) if p.has_penalties]
        if rows:
            logits = self._penalized(logits, reqs, rows)
        if masks is not None:
            logits = logits.masked_fill(~masks, float("-inf"))
        tokens = argmax_rows(logits) if all(p.is_greedy for p in params) else \
            self._sample_random(logits, reqs)
        if rows:  # counted on the device: a token still in flight counts next step
            self.stats.record([reqs[i] for i in rows], take_rows(tokens, rows))
        return tokens

    def _sample_random(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        params = [r.params for r in reqs]
        greedy = to_device([p.is_greedy for p in params], torch.bool, self.device)
        argmax = argmax_rows(logits)
        sampled = self.draw(self.probs(logits, params), reqs)
        return torch.where(greedy, argmax, sampled)

    def probs(self, logits: torch.Tensor, params: list) -> torch.Tensor:
        """The weights a sampled row draws with: softmax at the row's temperature (1 for
        greedy rows), then top-k / top-p / min-p zero some (rows are not renormalised).
        Speculative verification compares drafts against exactly this, normalised."""
        temps = to_device([1.0 if p.is_greedy else p.temperature for p in params],
                          logits.dtype, self.device)
        probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
        return _filter_top_k_top_p_min_p(probs, params, self.device)

    def uniform(self, req: Request, n: int) -> torch.Tensor:
        """n draws from U[0, 1), from the request's own generator when it has a seed."""
        gen = self._request_generator(req) if req.params.seed is not None else self.generator
        return torch.rand(n, device=self.device, generator=gen)

    def draw(self, probs: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """One token per row of `probs` [B, V] (rows need not be normalised), drawn with
        each request's generator (the shared one for unseeded requests)."""
        params = [r.params for r in reqs]
        noise = torch.empty_like(probs)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if len(unseeded) == len(params):
            noise.exponential_(generator=self.generator)
        elif unseeded:
            noise.index_copy_(0, to_device(unseeded, torch.long, self.device),
                              torch.empty((len(unseeded), probs.shape[1]), device=self.device,
                                          dtype=probs.dtype).exponential_(generator=self.generator))
        for i, req in enumerate(reqs):
            if req.params.seed is not None:
                noise[i].exponential_(generator=self._request_generator(req))
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws index i with probability p_i.
        return argmax_rows(probs / noise)

    def _request_generator(self, req: Request) -> torch.Generator:
        if req.sampler_state is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(req.params.seed)
            req.sampler_state = gen
        return req.sampler_state

    def apply_penalties(self, logits: torch.Tensor, reqs: list) -> torch.Tensor:
        """`logits` with each row's penalties, logit_bias and min_tokens applied, counted from
        the host lists `token_ids` and `output_ids` of `reqs` (any objects with those and
        `params`: speculative verification's what-if rows)."""
        counts = counts_from_lists(reqs, logits.shape[1], logits.device)
        return penalize(logits, reqs, counts, self.eos_token_ids)

    def release(self, req: Request) -> None:
        """The scheduler let the request go: its token counts' row is free."""
        if self.stats is not None:
            self.stats.release(req)

    def _penalized(self, logits: torch.Tensor, reqs: list[Request], rows: list[int]) -> torch.Tensor:
        """`logits` with the penalties of `rows` applied from the device-side token counts."""
        if self.stats is None:
            self.stats = TokenStats(logits.shape[1], logits.device)
        sub = [reqs[i] for i in rows]
        # logit_bias / min_tokens alone read no counts: no [B, V] gather for them
        counts = self.stats.rows(sub) if any(r.params.reads_token_counts for r in sub) else None
        if len(rows) == len(reqs):
            return penalize(logits, sub, counts, self.eos_token_ids)
        index = to_device(rows, torch.long, logits.device)
        edited = penalize(logits.index_select(0, index), sub, counts, self.eos_token_ids)
        return logits.index_copy(0, index, edited)

    @staticmethod
    def gather_logprobs(raw: torch.Tensor, tokens: torch.Tensor, params) -> tuple:
        """Each row's chosen token's logprob, and its top `top_logprobs` (id, logprob) pairs
        (None when no row asks for them)."""
        return Sampler.logprobs_to_lists(*Sampler.logprobs_on_device(raw, tokens, params), params)

    @staticmethod
    def logprobs_on_device(raw: torch.Tensor, tokens: torch.Tensor, params) -> tuple:
        """(chosen [B], top values [B, k], top ids [B, k]) left on the device; the top ones
        None when no row asks for them."""
        chosen = raw.gather(1, tokens.unsqueeze(1)).squeeze(1)
        k = max(p.top_logprobs for p in params)
        if k == 0:
            return chosen, None, None
        values, indices = raw.topk(k, dim=-1)
        return chosen, values, indices

    @staticmethod
    def logprobs_to_lists(chosen: torch.Tensor, values: torch.Tensor | None,
                          indices: torch.Tensor | None, params) -> tuple:
        """`logprobs_on_device`'s tensors (on the host by now) as `gather_logprobs` returns them."""
        if values is None:
            return chosen.tolist(), None
        values, indices = values.tolist(), indices.tolist()
        top = [list(zip(indices[i][:p.top_logprobs], values[i][:p.top_logprobs]))
               for i, p in enumerate(params)]
        return chosen.tolist(), top


def _filter_top_k_top_p_min_p(probs: torch.Tensor, params, device) -> torch.Tensor:
    """Zero the probabilities of tokens outside each row's top-k / top-p / min-p set: on a
    GPU by one threshold per row (engine/kernels/sampling_cut.py; ties at the cut all kept),
    else by sorting each row."""
    if all(p.top_k == -1 and p.top_p >= 1.0 and p.min_p == 0.0 for p in params):
        return probs
    vocab = probs.shape[1]
    top_k = to_device([p.top_k if p.top_k > 0 else vocab for p in params], torch.int32, device)
    top_p = to_device([p.top_p for p in params], probs.dtype, device)
    min_p = to_device([p.min_p for p in params], probs.dtype, device)
    if SORT_FREE_CUT and probs.is_cuda and probs.dtype == torch.float32:
        from engine.kernels.sampling_cut import sampling_cut

        find_k, find_p = any(p.top_k > 0 for p in params), any(p.top_p < 1.0 for p in params)
        cut = sampling_cut(probs, top_k, top_p, min_p, find_k, find_p)
        return probs.masked_fill(probs < cut.unsqueeze(1), 0.0)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=device).unsqueeze(0)
    cum_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
    drop = (rank >= top_k.unsqueeze(1)) | (cum_before >= top_p.unsqueeze(1))
    drop |= sorted_probs < min_p.unsqueeze(1) * sorted_probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)
