"""The Llama-family decoder: Llama 2/3, Mistral, Qwen2 and Qwen3 share one implementation.

Differences between the families are a few switches read from the HF config:
- Qwen2: bias on q/k/v (not on o_proj).
- Qwen3: per-head RMSNorm on q and k before RoPE; head_dim given by the config.
- Llama: optional `attention_bias` / `mlp_bias`; Llama 3.1 RoPE scaling (handled in rotary.py).
- Sliding-window attention (Mistral v0.1's `sliding_window`; Qwen2/Qwen3 `use_sliding_window`,
  per layer by `layer_types`): each layer's window goes to the attention backend (torch and
  Triton both mask by it). A backend without windows is refused once the context could
  outgrow the smallest window.

Module and parameter names follow HF's, except the fused `qkv_proj` and `gate_up_proj`, so
`load_weights` maps checkpoint names with a small table.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from engine.attention.base import AttentionBackend, ForwardBatch
from engine.layers.activation import SiluAndMul
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import (LinearBase, MergedColumnParallelLinear, QKVParallelLinear,
                                  RowParallelLinear)
from engine.layers.norm import RMSNorm
from engine.layers.parallel import Loadable, TPContext, copy_into, materialize
from engine.layers.rotary import RotaryEmbedding, get_rope
from engine.kernels.split_sums import SplitSums
from engine.loading.hf_shapes import attention_scale, head_dim_of

# checkpoint name piece -> (our fused parameter piece, shard id)
_STACKED = [
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
]


def _our_name(ckpt_name: str) -> tuple[str, str | int | None]:
    """Checkpoint parameter name -> (our parameter name, shard id within a fused one)."""
    for ckpt_piece, our_piece, shard_id in _STACKED:
        if ckpt_piece in ckpt_name:
            return ckpt_name.replace(ckpt_piece, our_piece), shard_id
    return ckpt_name, None


def _load_replicated(param: nn.Parameter, loaded: Loadable) -> None:
    copy_into(param, materialize(loaded))  # norms: the same on every rank


def sliding_windows(hf_config: Any) -> list[int | None]:
    """Each layer's attention window (None: full causal), as transformers reads the config:
    with `layer_types` (Qwen2, Qwen3, Qwen2-MoE) only the "sliding_attention" layers have
    one; without (Mistral, Mixtral, Qwen3-MoE) every layer has `sliding_window` when set.
    The config classes already clear `sliding_window` when `use_sliding_window` is off."""
    n = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None) or None  # Qwen2-MoE writes 0 for off
    types = getattr(hf_config, "layer_types", None)
    if not types:
        return [window] * n
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"layer_types {sorted(unknown)} are not supported "
                         "(only full_attention and sliding_attention)")
    return [window if kind == "sliding_attention" else None for kind in types[:n]]


class LlamaAttention(nn.Module):
    def __init__(self, hf_config: Any, layer_id: int, rotary_emb: RotaryEmbedding,
                 tp: TPContext, qk_norm: bool | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = head_dim_of(hf_config)
        model_type = getattr(hf_config, "model_type", "llama")
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        qwen2 = model_type in ("qwen2", "qwen2_moe")  # bias on q/k/v only (Qwen2-MoE: `qkv_bias`)
        qkv_bias = bool(getattr(hf_config, "qkv_bias", True)) if qwen2 else attention_bias
        o_bias = False if qwen2 else attention_bias
        self.qkv_proj = QKVParallelLinear(hf_config.hidden_size, self.head_dim,
                                          hf_config.num_attention_heads,
                                          hf_config.num_key_value_heads, qkv_bias, tp)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(hf_config.num_attention_heads * self.head_dim,
                                        hf_config.hidden_size, o_bias, tp)
        self.qk_norm = model_type in ("qwen3", "qwen3_moe") if qk_norm is None else qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps)
        self.rotary_emb = rotary_emb  # one cos/sin cache shared by all layers
        self.attn_backend: AttentionBackend | None = None  # set by LlamaForCausalLM
        self.qkv_proj.split_sums_ok = True  # RoPE adds a GEMV's partial sums (forward_split_sums)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch
                ) -> torch.Tensor | SplitSums:
        qkv = self.qkv_proj(x)
        norms = (self.q_norm, self.k_norm) if self.qk_norm else None
        if isinstance(qkv, SplitSums):
            q, k, v = self.rotary_emb.forward_split_sums(
                positions, qkv, (self.num_heads, self.num_kv_heads, self.head_dim), norms)
        else:
            q, k, v = self.qkv_proj.split(qkv)
            q = q.view(-1, self.num_heads, self.head_dim)
            k = k.view(-1, self.num_kv_heads, self.head_dim)
            v = v.view(-1, self.num_kv_heads, self.head_dim)
            q, k = self.rotary_emb(positions, q, k, norms)
        out = self.attn_backend.forward(q, k, v, self.layer_id, batch)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU MLP; MoE models reuse it for shared experts (own width, sum left unreduced)."""

    def __init__(self, hf_config: Any, tp: TPContext, intermediate_size: int | None = None,
                 reduce_results: bool = True) -> None:
        super().__init__()
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf_config.hidden_act!r} (only silu)")
        bias = bool(getattr(hf_config, "mlp_bias", False))
        inter = intermediate_size or hf_config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hf_config.hidden_size, [inter, inter], bias, tp)
        self.down_proj = RowParallelLinear(inter, hf_config.hidden_size, bias, tp,
                                           reduce_results=reduce_results)
        self.act_fn = SiluAndMul()
        self.gate_up_proj.split_sums_ok = True  # act_fn adds a GEMV's partial sums

    @property
    def split_sums_ok(self) -> bool:
        """Whether the output may be down_proj's partial sums (its consumer adds them)."""
        return self.down_proj.split_sums_ok

    @split_sums_ok.setter
    def split_sums_ok(self, ok: bool) -> None:
        self.down_proj.split_sums_ok = ok

    def quantized_input_pairs(self) -> list[tuple[nn.Module, LinearBase]]:
        """(kernel, linear) pairs where only the linear reads the kernel's output: an FP8
        linear's input quantization may run in that kernel (`set_fused_kernels`)."""
        return [(self.act_fn, self.down_proj)]

    def forward(self, x: torch.Tensor) -> torch.Tensor | SplitSums:
        h = self.gate_up_proj.silu_mul_gemv(x) if self.act_fn.fused else None
        if h is None:
            h = self.act_fn(self.gate_up_proj(x))
        return self.down_proj(h)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, layer_id: int, rotary_emb: RotaryEmbedding,
                 tp: TPContext, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(hf_config, layer_id, rotary_emb, tp)
        self.mlp = mlp if mlp is not None else LlamaMLP(hf_config, tp)  # MoE models pass theirs
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        # Outputs only RMSNorms read (this layer's second, the next layer's first, the final
        # one) may stay a GEMV's partial sums: the norms add them (engine/kernels/split_sums.py).
        self.self_attn.o_proj.split_sums_ok = True
        self.mlp.split_sums_ok = True

    def quantized_input_pairs(self) -> list[tuple[nn.Module, LinearBase]]:
        """As `LlamaMLP.quantized_input_pairs`: the norms before qkv and, in a dense MLP,
        gate_up (an MoE block's router reads its input too)."""
        pairs = [(self.input_layernorm, self.self_attn.qkv_proj)]
        if isinstance(self.mlp, LlamaMLP):
            pairs.append((self.post_attention_layernorm, self.mlp.gate_up_proj))
        return pairs

    def forward(self, positions: torch.Tensor, x: torch.Tensor | SplitSums,
                residual: torch.Tensor | None, batch: ForwardBatch
                ) -> tuple[torch.Tensor | SplitSums, torch.Tensor]:
        # The residual stream is carried separately so each add fuses into the next norm.
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, hf_config: Any, tp: TPContext,
                 make_mlp: Callable[[int], nn.Module | None] = lambda layer_id: None,
                 rotary_emb: RotaryEmbedding | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, tp)
        rotary_emb = rotary_emb or get_rope(hf_config, head_dim_of(hf_config))
        self.layers = nn.ModuleList(LlamaDecoderLayer(hf_config, i, rotary_emb, tp, make_mlp(i))
                                    for i in range(hf_config.num_hidden_layers))
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, batch)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """`model(batch)` -> final hidden states [T, hidden]; `compute_logits` -> [B, vocab] float32.

    The model runner calls `attn_backend.prepare(batch)` before each forward; the model
    only calls `attn_backend.forward` once per layer.
    """

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend | None = None,
                 tp: TPContext | None = None) -> None:
        super().__init__()
        self.config = hf_config
        self.tp = tp or TPContext()
        self.model = self.build_model(hf_config)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, self.tp)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        attn = self.model.layers[0].self_attn
        # Per-rank attention shape: what the KV pool is sized by.
        self.head_dim, self.num_kv_heads = attn.head_dim, attn.num_kv_heads
        self.num_layers = hf_config.num_hidden_layers
        self.scale = attention_scale(hf_config)
        self.sliding_windows = sliding_windows(hf_config)
        # The smallest window when the backend ignores windows: contexts must stay within it.
        self._full_attention_limit: int | None = None
        self.lora_batch = None  # set when adapters serve (engine/lora/manager.py)
        if attn_backend is not None:
            self.set_attention_backend(attn_backend)

    def build_model(self, hf_config: Any) -> nn.Module:
        """The decoder stack (other families with Llama's interface override it)."""
        return LlamaModel(hf_config, self.tp, self.make_mlp)

    def make_mlp(self, layer_id: int) -> nn.Module | None:
        """The MLP of layer `layer_id`; None for the dense default (MoE subclasses override)."""
        return None

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def set_attention_backend(self, attn_backend: AttentionBackend) -> None:
        for layer in self.model.layers:
            layer.self_attn.attn_backend = attn_backend
        windows = {i: w for i, w in enumerate(self.sliding_windows) if w is not None}
        self._full_attention_limit = None
        if windows and getattr(attn_backend, "supports_sliding_window", False):
            attn_backend.set_sliding_windows(windows)
        elif windows:
            self._full_attention_limit = min(windows.values())

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self._check_context_fits_windows(batch)
        if self.lora_batch is not None:  # LoRA adapters (engine/lora/layer.py) see the step
            self.lora_batch.begin(batch)
        return self.model(batch.input_ids, batch.positions, batch)

    def _check_context_fits_windows(self, batch: ForwardBatch) -> None:
        """Full causal attention equals windowed attention only while no sequence outgrows
        the window. The request table's width is the engine's context limit, so this fails
        at the first forward (graph capture or warm-up at start-up on GPUs), not once a long
        request arrives."""
        limit = self._full_attention_limit
        if limit is not None and batch.req_to_token.shape[1] > limit:
            backend = type(self.model.layers[0].self_attn.attn_backend).__name__
            raise ValueError(
                f"sliding_window={limit}: {backend} has no sliding-window attention and the "
                f"context limit {batch.req_to_token.shape[1]} exceeds the window; set "
                f"max_model_len <= {limit} or use attention_backend='torch'")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, Loadable]]) -> set[str]:
        """Copy checkpoint tensors (or lazy safetensors slices) into this rank's shards.

        Returns the names of our parameters that were fully loaded, so callers can check
        that nothing is missing (see `missing_weights`).
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded_names: set[str] = set()
        shards_seen: dict[str, set] = defaultdict(set)
        for name, loaded in weights:
            if "rotary_emb.inv_freq" in name:
                continue  # recomputed here
            if self.tie_word_embeddings and name.startswith("lm_head."):
                continue  # the same tensor as the embedding
            target, shard_id = _our_name(name)
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint weight {name!r} has no place in {type(self).__name__}")
            if shard_id is None:
                getattr(param, "weight_loader", _load_replicated)(param, loaded)
                loaded_names.add(target)
                continue
            param.weight_loader(param, loaded, shard_id)
            shards_seen[target].add(shard_id)
            if len(shards_seen[target]) == (3 if ".qkv_proj." in target else 2):
                loaded_names.add(target)  # a fused parameter is loaded once all its shards are
        if self.tie_word_embeddings and "model.embed_tokens.weight" in loaded_names:
            loaded_names.add("lm_head.weight")
        return loaded_names

    def missing_weights(self, loaded_names: set[str]) -> list[str]:
        return sorted(set(dict(self.named_parameters(remove_duplicate=False))) - loaded_names)
