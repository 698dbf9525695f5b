"""BERT-family encoders (BERT, RoBERTa, XLM-R) over packed batches: embedding models (with a
sentence-transformers pooling on top, engine/layers/pooler.py) and cross-encoder rerankers
(`*ForSequenceClassification`: one logit per (query, document) pair).

Inputs arrive packed (T tokens of B sequences back to back, `lens`); every linear runs on
the T real tokens only and attention keeps each sequence to itself (engine/attention/varlen.py)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.varlen import PackedLayout, varlen_attention

ENCODER_TYPES = ("bert", "roberta", "xlm-roberta")
_PREFIXES = ("bert.", "roberta.", "model.")
_ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


def is_encoder(hf_config: Any) -> bool:
    return getattr(hf_config, "model_type", "") in ENCODER_TYPES


class EncoderLayer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = h // self.num_heads
        self.qkv = nn.Linear(h, 3 * h)  # the checkpoint's query, key and value, fused at load
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.up = nn.Linear(h, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
        q, k, v = self.qkv(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        a = varlen_attention(q, k, v, layout, causal=False, scale=self.head_dim ** -0.5)
        x = self.attn_norm(x + self.attn_out(a.reshape(x.shape)))
        return self.out_norm(x + self.down(self.act(self.up(x))))


class Encoder(nn.Module):
    """Embeddings (word + position + token type, LayerNorm) and the layers: packed hidden
    states [T, hidden] out."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.word = nn.Embedding(cfg.vocab_size, h)
        self.position = nn.Embedding(cfg.max_position_embeddings, h)
        self.token_type = nn.Embedding(max(1, getattr(cfg, "type_vocab_size", 1)), h)
        self.norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        # RoBERTa and XLM-R count positions from padding_idx + 1.
        roberta = cfg.model_type in ("roberta", "xlm-roberta")
        self.position_offset = (cfg.pad_token_id + 1) if roberta else 0
        self.max_tokens = cfg.max_position_embeddings - self.position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: PackedLayout,
                token_types: torch.Tensor | None = None) -> torch.Tensor:
        """`positions`: each token's place in its own sequence (from 0)."""
        if self.position_offset:
            positions = positions + self.position_offset
        x = self.word(input_ids) + self.position(positions)
        # no token types: every token is type 0 (its row added without an index tensor)
        if token_types is None:
            x = x + self.token_type.weight[0]
        else:
            x = x + self.token_type(token_types)
        x = self.norm(x)
        for layer in self.layers:
            x = layer(x, layout)
        return x


class EncoderModel(nn.Module):
    """`BertModel` / `XLMRobertaModel` (embedders): hidden states; `*ForSequenceClassification`
    (rerankers): also `classify(hidden, cu_seqlens)` -> [B, num_labels] logits from each
    first token."""

    def __init__(self, cfg: Any, classifier: bool = False) -> None:
        super().__init__()
        self.config = cfg
        self.encoder = Encoder(cfg)
        self.roberta_head = cfg.model_type in ("roberta", "xlm-roberta")
        self.classifier = classifier
        if classifier:  # BERT: pooler (dense + tanh) then a linear; RoBERTa: dense, tanh, out_proj
            self.head_dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
            self.head_out = nn.Linear(cfg.hidden_size, cfg.num_labels)

    @property
    def max_tokens(self) -> int:
        return self.encoder.max_tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: PackedLayout,
                token_types: torch.Tensor | None = None) -> torch.Tensor:
        return self.encoder(input_ids, positions, layout, token_types)

    def classify(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        first = hidden[cu_seqlens[:-1].long()]
        return self.head_out(torch.tanh(self.head_dense(first))).float()

    def load_weights(self, weights) -> None:
        """Copy HF checkpoint tensors in (names with or without the `bert.`/`roberta.`
        prefix); raises ValueError naming what is missing or has no place here."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self._our_name(name)
            if target is None:
                continue
            ours, part = target
            param = params.get(ours)
            if param is None:
                raise ValueError(f"checkpoint weight {name!r} has no place in the encoder")
            with torch.no_grad():
                t = torch.as_tensor(tensor[:] if not isinstance(tensor, torch.Tensor) else tensor)
                if part is None:
                    param.copy_(t)
                else:
                    rows = param.shape[0] // 3
                    param[part * rows:(part + 1) * rows].copy_(t)
            loaded.add(ours if part is None else f"{ours}#{part}")
        fused = {n for n in params if ".qkv." in n}
        missing = ({n for n in params if n not in fused} - loaded) | {
            f"{n}#{i}" for n in fused for i in range(3)} - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} encoder weight(s), e.g. {sorted(missing)[:4]}")

    def _our_name(self, name: str) -> tuple[str, int | None] | None:
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        if name.endswith("position_ids") or name.startswith(("lm_head.", "cls.")):
            return None
        if name.startswith(("pooler.", "classifier.")):
            return self._head_name(name) if self.classifier else None
        return _encoder_name(name)

    def _head_name(self, name: str) -> tuple[str, None]:
        leaf = name.rsplit(".", 1)[1]
        if name.startswith("pooler.dense.") or name.startswith("classifier.dense."):
            return f"head_dense.{leaf}", None
        return f"head_out.{leaf}", None  # BERT's classifier.{weight,bias}, RoBERTa's out_proj


_EMBEDDINGS = {"word_embeddings": "word", "position_embeddings": "position",
               "token_type_embeddings": "token_type", "LayerNorm": "norm"}
_LAYER_PARTS = {"attention.output.dense": "attn_out", "attention.output.LayerNorm": "attn_norm",
                "intermediate.dense": "up", "output.dense": "down", "output.LayerNorm": "out_norm"}
_QKV = {"attention.self.query": 0, "attention.self.key": 1, "attention.self.value": 2}


def _encoder_name(name: str) -> tuple[str, int | None]:
    parts = name.split(".")
    if parts[0] == "embeddings":
        return f"encoder.{_EMBEDDINGS.get(parts[1], parts[1])}.{parts[-1]}", None
    if parts[:2] == ["encoder", "layer"]:
        layer, inner, leaf = parts[2], ".".join(parts[3:-1]), parts[-1]
        if inner in _QKV:
            return f"encoder.layers.{layer}.qkv.{leaf}", _QKV[inner]
        return f"encoder.layers.{layer}.{_LAYER_PARTS.get(inner, inner)}.{leaf}", None
    return name, None
