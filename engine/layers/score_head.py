"""The head of a decoder `*ForSequenceClassification` model (Qwen3-Reranker-style
rerankers converted to sequence classification, Llama/Mistral/Qwen2 classifiers): a bias-free
linear over the hidden state of each sequence's last token, as transformers applies it to
the last non-padding token."""
from __future__ import annotations

import torch
from torch import nn


class LastTokenScoreHead(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # (num_labels, hidden)

    def forward(self, hidden: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """(sum(lens), hidden) packed states -> (len(lens), num_labels) float32 logits."""
        last = torch.tensor(lens, device=hidden.device).cumsum(0) - 1
        return (hidden[last] @ self.weight.to(hidden.dtype).t()).float()
