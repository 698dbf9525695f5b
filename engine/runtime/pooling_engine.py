"""The engine of the pooling tasks (`task: embed` or `score`): one forward per batch of
inputs, no KV cache, no decoding.

Embedders: BERT-family encoders (engine/models/bert.py) pooled as their
sentence-transformers config says, or a Llama/Qwen decoder pooled at its last token
(engine/attention/varlen.py's packed causal backend: no KV is written). Scorers:
`*ForSequenceClassification` cross-encoders (BERT family) and decoder classifiers (their
last token's hidden state through a linear), one logit per (query, document) pair.
Inputs are sorted by length and packed into forwards of at most `max_prefill_tokens`
tokens and `max_running_requests` sequences (engine/runtime/pooling_batch.py: numpy on the
host, one upload per forward); an input's result does not depend on what it was packed
with. The forwards' results stay on the device until the call's last one is queued, then
come back in one copy: the host never waits for a forward in between."""
from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.varlen import PackedCausalBackend, PackedLayout, packed_batch
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
from engine.runtime.pooling_batch import (CallPlan, DeviceForward, flat_ids, input_lens,
                                          pack_forward, plan_call, upload)
from engine.runtime.pooling_input import PoolInput

Head = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (hidden, cu_seqlens) -> rows


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
        # the packed Triton kernel on a GPU unless the torch backend is asked for
        backend = config.attention_backend
        self.use_triton = backend == "triton" or (backend == "auto" and self.device.type == "cuda")
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
        if self.use_triton:
            self._compile_kernels()

    @torch.inference_mode()
    def _compile_kernels(self) -> None:
        """One tiny forward, so the attention kernel's compile happens at start-up and not
        on the first request."""
        self._run([PoolInput([0, 0])], lambda hidden, cu: hidden[cu[1:].long() - 1])
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
        model.set_attention_backend(PackedCausalBackend(model.scale, self.use_triton))
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

    def encode_many(self, texts: list[str], truncate: int | None = None) -> list[PoolInput]:
        """Token ids of each text with the tokenizer's special tokens, in one batched call;
        `truncate` (tokens) cuts a text so the whole input, special tokens included, fits."""
        kw = {"truncation": True, "max_length": truncate} if truncate is not None else {}
        return [PoolInput(ids) for ids in self.tokenizer.hf(texts, **kw)["input_ids"]]

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
    def embed(self, items: list[PoolInput], dimensions: int | None = None) -> torch.Tensor:
        """[len(items), dimensions or hidden] float32 on the host, one row per input, in order."""
        return self._run(items, lambda hidden, cu: pool(hidden, cu, self.spec, dimensions))

    @torch.inference_mode()
    def score(self, items: list[PoolInput]) -> list[float]:
        """One relevance logit per (query, document) input (the classifier's first label)."""
        classify = self.score_head if self.score_head is not None else self.model.classify
        return self._run(items, lambda hidden, cu: classify(hidden, cu)[:, 0]).tolist()

    def check_all(self, items: list[PoolInput]) -> None:
        """`check` for every input at once (vectorized; `check` names the first bad one)."""
        self._check_lens(items, input_lens(items))
        try:
            ids = flat_ids(items)
        except OverflowError:  # an id past int64 is out of the vocabulary too
            ids = None
        self._check_ids(items, ids)

    def _check_lens(self, items: list[PoolInput], lens: np.ndarray) -> None:
        if not lens.all() or lens.max(initial=0) > self.max_context:
            for item in items:
                self.check(item)

    def _check_ids(self, items: list[PoolInput], ids: np.ndarray | None) -> None:
        if ids is None or (ids.size and (ids.min() < 0 or ids.max() >= self.hf_config.vocab_size)):
            for item in items:
                self.check(item)

    def _run(self, items: list[PoolInput], head: Head) -> torch.Tensor:
        if not items:
            return torch.empty(0)
        started = time.perf_counter()
        lens = input_lens(items)
        self._check_lens(items, lens)
        plan = plan_call(items, lens, max(self.config.max_prefill_tokens, self.max_context),
                         self.config.max_running_requests)
        rows = []
        for first, end in plan.bounds:
            host = self._packed(items, plan, first, end)
            fwd = upload(host, plan.lens[first:end], plan.has_types, self.device)
            rows.append(self._forward(fwd, head))
        sorted_rows = torch.cat(rows).cpu()  # the call's one wait for the device
        out = torch.empty_like(sorted_rows)
        out[torch.from_numpy(plan.order)] = sorted_rows
        self.stats.forwards += len(rows)
        self.stats.forward_seconds += time.perf_counter() - started
        self.stats.inputs += len(items)
        self.stats.prompt_tokens += int(lens.sum())
        return out

    def _packed(self, items: list[PoolInput], plan: CallPlan, first: int, end: int) -> np.ndarray:
        """The host buffer of the forward of sorted inputs [first, end); ValueError for an
        id out of the vocabulary (checked here, where the ids are gathered anyway)."""
        try:
            host = pack_forward(items, plan, first, end)
        except OverflowError:  # an id past int64
            host = None
        t = int(plan.lens[first:end].sum())
        if host is None or host[:t].min() < 0 or host[:t].max() >= self.hf_config.vocab_size:
            self._check_ids([items[i] for i in plan.order[first:end].tolist()], None)
        return host

    def _forward(self, fwd: DeviceForward, head: Head) -> torch.Tensor:
        layout = PackedLayout(fwd.lens, fwd.cu_seqlens, max(fwd.lens), self.use_triton)
        if self.encoder:
            hidden = self.model(fwd.input_ids, fwd.positions, layout, fwd.token_types)
        else:
            hidden = self.model(packed_batch(fwd.input_ids, fwd.positions, layout,
                                             self.max_context))
        return head(hidden, fwd.cu_seqlens)

    def stats_dict(self) -> dict:
        s = self.stats
        return {"task": self.task, "requests": s.requests, "inputs": s.inputs,
                "prompt_tokens": s.prompt_tokens, "forwards": s.forwards,
                "forward_seconds": s.forward_seconds}
