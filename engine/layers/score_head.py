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

    def forward(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """(T, hidden) packed states, sequence i rows [cu[i], cu[i+1]) -> (B, num_labels)
        float32 logits."""
        last = cu_seqlens[1:].long() - 1
        return (hidden[last] @ self.weight.to(hidden.dtype).t()).float()
