"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.parallel import Loadable, TPContext, copy_into, loaded_shape, narrow


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r * V_local, (r+1) * V_local) of the (padded) embedding table.

    The vocabulary is padded up to a multiple of the TP size; padded rows are zero.
    At tp > 1 each rank embeds the ids it owns, zeros the others, and the ranks all-reduce.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPContext | None = None) -> None:
        super().__init__()
        self.tp = tp or TPContext()
        self.vocab_size = vocab_size
        self.vocab_per_rank = -(-vocab_size // self.tp.size)
        self.vocab_start = self.tp.rank * self.vocab_per_rank
        self.weight = nn.Parameter(torch.empty(self.vocab_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Loadable) -> None:
        total = loaded_shape(loaded)[0]
        if total != self.vocab_size:
            raise ValueError(f"embedding has {total} rows, config says vocab_size={self.vocab_size}")
        n = max(0, min(self.vocab_per_rank, total - self.vocab_start))
        with torch.no_grad():
            param[n:].zero_()
        copy_into(param[:n], narrow(loaded, 0, self.vocab_start, n))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to vocabulary logits; same sharding as the embedding, so a
    tied head can share the embedding's weight parameter."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits, dim=-1)[..., :self.vocab_size]
        return logits

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not an embedding; call compute_logits(hidden)")
