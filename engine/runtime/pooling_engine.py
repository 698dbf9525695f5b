"""The engine of the pooling tasks (`task: embed` or `score`): one forward per batch of
inputs, no KV cache, no decoding.

Embedders: BERT-family encoders (engine/models/bert.py) pooled as their
sentence-transformers config says, or a Llama/Qwen decoder pooled at its last token
(engine/attention/varlen.py's packed causal backend: no KV is written). Scorers:
`*ForSequenceClassification` cross-encoders (BERT family) and decoder classifiers (their
last token's hidden state through a linear), one logit per (query, document) pair.
Inputs are sorted by length and packed into forwards of at most `max_prefill_tokens`
tokens and `max_running_requests` sequences; an input's result does not depend on what it
was packed with."""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from engine.attention.varlen import PackedCausalBackend, packed_batch
from engine.config import EngineConfig
from engine.layers.pooler import PoolingSpec, pool
from engine.layers.score_head import LastTokenScoreHead
from engine.loading.model_source import resolve_model_path
from engine.loading.pooling_config import max_seq_length, read_pooling_spec
from engine.loading.tokenizer import Tokenizer
from engine.loading.weights import dummy_init_, iterate_safetensors, tensor_shapes
from engine.models import load_model
from engine.loading.hf_config import load_hf_config, resolve_device, resolve_dtype
from engine.models.bert import EncoderModel, is_encoder
from engine.runtime.pooling_input import PoolInput


@dataclass
class PoolingStats:
    requests: int = 0
    inputs: int = 0
    prompt_tokens: int = 0
    forwards: int = 0
    forward_seconds: float = 0.0


class PoolingEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.task == "generate":
            raise ValueError("PoolingEngine serves task 'embed' or 'score'")
        self.config = config
        self.task = config.task
        path = resolve_model_path(config.model)
        self.tokenizer = Tokenizer(config.tokenizer or config.model)
        hf_config = load_hf_config(path)
        self.hf_config = hf_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, hf_config, self.device)
        self.encoder = is_encoder(hf_config)
        archs = list(getattr(hf_config, "architectures", None) or [])
        self.classifier = any(a.endswith("ForSequenceClassification") for a in archs)
        if self.task == "score" and not self.classifier:
            raise ValueError(f"task 'score' needs a cross-encoder (a *ForSequenceClassification "
                             f"model: BERT/RoBERTa/XLM-R, or a Llama/Qwen decoder); "
                             f"{config.model} is {archs}")
        self.score_head: LastTokenScoreHead | None = None
        self.model = self._load(path, hf_config)
        self.spec: PoolingSpec = read_pooling_spec(path, self.encoder)
        limits = [self.model.max_tokens if self.encoder else hf_config.max_position_embeddings,
                  config.max_model_len, max_seq_length(path)]
        self.max_context = min(x for x in limits if x)
        self.hidden_size = hf_config.hidden_size
        self.matryoshka = bool(getattr(hf_config, "is_matryoshka", False)
                               or getattr(hf_config, "matryoshka_dimensions", None))
        self.stats = PoolingStats()

    def _load(self, path: str, hf_config) -> torch.nn.Module:
        if not self.encoder:
            return self._load_decoder(path, hf_config)
        old = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with self.device:
                model = EncoderModel(hf_config, classifier=self.classifier)
        finally:
            torch.set_default_dtype(old)
        if self.config.load_format == "dummy":
            dummy_init_(model, self.config.seed)
        else:
            model.load_weights(iterate_safetensors(path))
        return model.eval()

    def _load_decoder(self, path: str, hf_config) -> torch.nn.Module:
        """A Llama/Qwen model whose attention is the packed causal backend. Embedding
        checkpoints saved from the base model (Qwen3-Embedding: `layers.0...`, no `model.`
        prefix and no LM head) are read with the prefix put back, and a classifier's
        (`model.*` + `score.weight`) with its head apart; the unused LM head stays as built."""
        names = tensor_shapes(path) if self.config.load_format == "safetensors" else {}
        bare = bool(names) and not any(n.startswith(("model.", "lm_head.")) for n in names)
        own_loader = bare or (self.classifier and bool(names))
        causal = hf_config
        if self.classifier:  # the same body as the family's causal LM
            causal = copy.copy(hf_config)
            causal.architectures = [a.replace("ForSequenceClassification", "ForCausalLM")
                                    for a in hf_config.architectures]
        model = load_model(path, dtype=self.dtype, device=self.device, seed=self.config.seed,
                           load_format="dummy" if own_loader else self.config.load_format,
                           hf_config=causal)
        if own_loader:
            self._load_body(model, path, prefix="model." if bare else "")
        elif self.classifier:  # dummy weights: a random head of the configured labels
            gen = torch.Generator().manual_seed(self.config.seed)
            weight = torch.randn(hf_config.num_labels, hf_config.hidden_size, generator=gen) * 0.02
            self.score_head = LastTokenScoreHead(weight.to(self.device, self.dtype))
        model.set_attention_backend(PackedCausalBackend(model.scale))
        return model

    def _load_body(self, model: torch.nn.Module, path: str, prefix: str) -> None:
        head: list[torch.Tensor] = []

        def body():
            for name, tensor in iterate_safetensors(path):
                if self.classifier and name == "score.weight":
                    head.append(tensor)
                else:
                    yield prefix + name, tensor

        loaded = model.load_weights(body())
        missing = [n for n in model.missing_weights(loaded) if not n.startswith("lm_head.")]
        if missing:
            raise ValueError(f"{path}: checkpoint lacks {len(missing)} weight(s), e.g. {missing[:4]}")
        if self.classifier:
            if not head:
                raise ValueError(f"{path}: a *ForSequenceClassification checkpoint without "
                                 "`score.weight`")
            self.score_head = LastTokenScoreHead(head[0].to(self.device, self.dtype))

    # -- inputs -------------------------------------------------------------------------

    def encode(self, text: str, truncate: int | None = None) -> PoolInput:
        """Token ids of `text` with the tokenizer's special tokens; `truncate` (tokens)
        cuts the text so the whole input, special tokens included, fits in it."""
        if truncate is None:
            return PoolInput(self.tokenizer.hf.encode(text))
        return PoolInput(self.tokenizer.hf.encode(text, truncation=True, max_length=truncate))

    def encode_pair(self, query: str, document: str, truncate: int | None = None) -> PoolInput:
        """A cross-encoder's input: query and document as one sequence pair (the document
        is what `truncate` shortens)."""
        enc = self.tokenizer.hf(query, document, truncation="only_second" if truncate else False,
                                max_length=truncate)
        return PoolInput(list(enc["input_ids"]), list(enc.get("token_type_ids") or []) or None)

    def check(self, item: PoolInput) -> None:
        """Raise ValueError for an input that cannot run (empty, too long, out of vocab)."""
        n = len(item.ids)
        if n == 0:
            raise ValueError("input is empty")
        if n > self.max_context:
            raise ValueError(f"input has {n} tokens, more than this model's limit of "
                             f"{self.max_context}; shorten it or set truncate_prompt_tokens")
        vocab = self.hf_config.vocab_size
        if min(item.ids) < 0 or max(item.ids) >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab})")

    def check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None:
            return
        if not self.matryoshka:
            raise ValueError("this model does not support `dimensions` (it is not a Matryoshka "
                             "embedding model)")
        if not 1 <= dimensions <= self.hidden_size:
            raise ValueError(f"dimensions must be within 1-{self.hidden_size}, got {dimensions}")

    # -- forwards -----------------------------------------------------------------------

    @torch.inference_mode()
    def embed(self, items: list[PoolInput], dimensions: int | None = None) -> list[torch.Tensor]:
        """One float32 vector per input, in order."""
        return self._run(items, lambda hidden, lens: pool(hidden, lens, self.spec, dimensions))

    @torch.inference_mode()
    def score(self, items: list[PoolInput]) -> list[float]:
        """One relevance logit per (query, document) input (the classifier's first label)."""
        classify = self.score_head if self.score_head is not None else self.model.classify
        rows = self._run(items, lambda hidden, lens: classify(hidden, lens)[:, 0])
        return [float(r) for r in rows]

    def _run(self, items: list[PoolInput], head) -> list[torch.Tensor]:
        for item in items:
            self.check(item)
        order = sorted(range(len(items)), key=lambda i: len(items[i].ids))
        out: list[torch.Tensor | None] = [None] * len(items)
        for chunk in self._chunks(order, items):
            batch = [items[i] for i in chunk]
            for i, row in zip(chunk, self._forward(batch, head)):
                out[i] = row
        self.stats.inputs += len(items)
        self.stats.prompt_tokens += sum(len(x.ids) for x in items)
        return out

    def _chunks(self, order: list[int], items: list[PoolInput]) -> list[list[int]]:
        budget = max(self.config.max_prefill_tokens, self.max_context)
        chunks, current, tokens = [], [], 0
        for i in order:
            n = len(items[i].ids)
            if current and (tokens + n > budget or len(current) >= self.config.max_running_requests):
                chunks.append(current)
                current, tokens = [], 0
            current.append(i)
            tokens += n
        return chunks + ([current] if current else [])

    def _forward(self, batch: list[PoolInput], head) -> torch.Tensor:
        started = time.perf_counter()
        lens = [len(x.ids) for x in batch]
        ids = torch.tensor([t for x in batch for t in x.ids], device=self.device)
        if self.encoder:
            types = None
            if any(x.token_types for x in batch):
                types = torch.tensor([t for x in batch for t in (x.token_types or [0] * len(x.ids))],
                                     device=self.device)
            hidden = self.model(ids, lens, types)
        else:
            hidden = self.model(packed_batch(ids, lens, self.max_context))
        rows = head(hidden, lens).cpu()
        self.stats.forwards += 1
        self.stats.forward_seconds += time.perf_counter() - started
        return rows

    def stats_dict(self) -> dict:
        s = self.stats
        return {"task": self.task, "requests": s.requests, "inputs": s.inputs,
                "prompt_tokens": s.prompt_tokens, "forwards": s.forwards,
                "forward_seconds": s.forward_seconds}
