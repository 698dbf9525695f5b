"""Engine configuration: one plain dataclass, validated once at construction."""
from __future__ import annotations

import dataclasses
import functools
import numbers
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class KernelConfig:
    """Kernel paths each GPU step may take: all on by default, each switchable off for A/B
    runs (docs/engine.md lists what each one turns off). CPU tensors take torch paths anyway."""

    # Triton kernels launched under programmatic dependent launch (Hopper; engine/kernels/launch.py).
    pdl: bool = True
    # bf16/fp16 linears of up to `bf16_gemv_rows` rows on the Triton GEMV; False: cuBLAS always.
    triton_gemv: bool = True
    # 1, or 2-64: short prompts' extend steps on the GEMV too (chained under PDL instead of
    # draining around each cuBLAS GEMM). Above 1 not yet measured on a GPU.
    bf16_gemv_rows: int = 1
    # A norm / SiLU-and-mul quantizes the input of the FP8 linear after it in its own launch.
    fused_fp8_quant: bool = True
    # A GEMV's K-slice partial sums (and MoE experts' choices) summed by their consumer.
    split_sums: bool = True
    # One-row float8 GEMVs multiply on the tensor cores (False: the CUDA cores).
    fp8_row_dot: bool = True
    # The float8 SwiGLU gate_up GEMV and its SiLU-and-mul in one launch.
    glu_gemv: bool = True
    # The decode attention kernel stores the step's new K/V (False: a store kernel first).
    decode_stores_kv: bool = True
    # Top-k / top-p / min-p by a sort-free threshold search on GPUs (False: by sorting).
    sort_free_cut: bool = True

    def __post_init__(self) -> None:
        _check_field_types(self, prefix="kernels.")
        if not 1 <= self.bf16_gemv_rows <= 64:
            raise ValueError(f"kernels.bf16_gemv_rows must be within 1-64, got {self.bf16_gemv_rows}")

    @classmethod
    def of(cls, value: "KernelConfig | dict[str, Any]") -> "KernelConfig":
        """A KernelConfig, or one from a mapping of its fields (app args, a config that
        crossed a process as a dict); unknown names raise ValueError."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"kernels must be a mapping of kernel settings, got {value!r}")
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown kernel setting(s) {unknown}; known: "
                             f"{[f.name for f in dataclasses.fields(cls)]}")
        return cls(**value)


def _gc_freeze_default() -> bool:
    """Test plumbing, not a serving setting: the test suite (tests/conftest.py) builds
    hundreds of engines, in its own process and in Ray's, and each start's full collection
    would cost ~0.2 s on a 2-core box; RADIXSERVE_TEST_NO_GC_FREEZE=1 makes False the
    default there. A value given in the config always wins."""
    return os.environ.get("RADIXSERVE_TEST_NO_GC_FREEZE") != "1"


def default_cache_root() -> Path:
    """Where built artifacts (the demo model) are kept: RADIXSERVE_CACHE, a path for test
    plumbing and read-only homes, else ~/.cache/radixserve."""
    return Path(os.environ.get("RADIXSERVE_CACHE") or "~/.cache/radixserve").expanduser()


@dataclass
class EngineConfig:
    """Everything that shapes one engine instance.

    The KV pool is sized by `max_total_tokens` when given, otherwise by
    `mem_fraction_static` of the device memory left after loading weights.
    """

    model: str = ""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"
    device: str = "auto"  # "cpu", "cuda", "cuda:1", or "auto" (cuda when available)
    load_format: Literal["safetensors", "dummy"] = "safetensors"
    seed: int = 0
    tokenizer: str | None = None  # defaults to `model`
    # What the model serves: "generate" (text), "embed" (one vector per input: a BERT-family
    # encoder, or a Llama/Qwen decoder pooled at its last token) or "score" (a cross-encoder
    # reranker's logit per query-document pair); engine/runtime/pooling_engine.py.
    task: Literal["generate", "embed", "score"] = "generate"

    # Scheduling
    max_running_requests: int = 256
    chunked_prefill_size: int = 2048  # max new prompt tokens per step; <= 0 disables chunking
    max_prefill_tokens: int = 16384  # token budget of one step's prefill part
    max_queued_requests: int = 0  # 0 = unbounded; above it `add_request` raises QueueFullError
    enable_radix_cache: bool = True
    schedule_policy: Literal["fcfs", "lpm"] = "fcfs"  # admission order: engine/core/admission.py
    # Requests' `priority` (lower first; engine/core/admission.py): "preempt" admits by priority
    # and, when the batch is full, retracts running requests of a lower priority for a
    # waiting higher one; "order" only admits by priority; "off" refuses any priority but 0
    # (a server whose clients should not be able to jump the queue).
    priority_scheduling: Literal["preempt", "order", "off"] = "preempt"
    # The longest a request may wait for its first admission (seconds; None: no limit).
    # Past it the request ends with QueueTimeoutError (engine/core/queue_deadlines.py).
    max_queue_time_s: float | None = None

    # Memory
    max_total_tokens: int | None = None  # KV slots in the pool
    mem_fraction_static: float = 0.85
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    # Host tier under the radix cache (engine/core/host_tier.py): GiB of host memory (pinned
    # on a GPU) that keeps the KV the device pool evicts, loaded back when a prefix returns.
    # 0 = off (evicted KV is dropped). "lazy" copies a node out when the device evicts it,
    # "eager" when it enters the tree (eviction then only frees slots).
    host_kv_cache_gb: float = 0.0
    host_kv_write_back: Literal["lazy", "eager"] = "lazy"

    # FP8 (engine/quantization/): "fp8" quantizes bf16/fp32 weights at load (per-output-channel
    # scales, dynamic per-token activation scales). A checkpoint whose config.json has an FP8
    # quantization_config loads as FP8 whatever this says.
    quantization: Literal["fp8"] | None = None
    # FP8 GEMMs above decode-sized batches (`torch._scaled_mm`): accumulate in the tensor
    # cores' own precision (True, as vLLM's and SGLang's CUTLASS FP8 kernels do on Hopper), or
    # promote partial sums to float32 along K (False: 2-22% slower GEMMs).
    fp8_fast_accum: bool = True
    # "fp8_e4m3": the KV pool stores float8 (half of bf16's bytes, so twice the tokens).
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = "auto"

    # Kernels
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    # Large prefill/extend steps (>= 4,096 new tokens, >= 1,024 per request) of the Triton
    # backend: "flashinfer" = FlashInfer's Hopper (fa3) kernel, 1.2-1.4x faster on long
    # prompts (engine/attention/flashinfer_prefill.py; the package is optional; its kernel is
    # built at start-up, 110 s once, then cached); "auto" = FlashInfer when it can serve
    # (installed, sm_90, a bf16/fp16 KV cache) and its kernel is built already, else Triton;
    # "triton" = never FlashInfer.
    prefill_attention_backend: Literal["auto", "triton", "flashinfer"] = "auto"
    enable_cuda_graph: bool = True
    # RMSNorm (+ residual add), RoPE and SiLU-and-mul as one Triton kernel each (GPU only).
    enable_fused_kernels: bool = True
    cuda_graph_max_bs: int = 256
    # Prefill/extend steps of at most this many new tokens over at most _bs requests replay
    # a CUDA graph (engine/executor/graph_runner.py): short prompts are launch-bound. 0 disables.
    # None = 16 requests, or 64 with speculative decoding (its verify steps are extends of
    # k + 1 tokens per decoding request, and drafts are only made for steps a graph covers).
    cuda_graph_max_extend_tokens: int = 1024
    cuda_graph_max_extend_bs: int | None = None
    enable_overlap_schedule: bool = True
    # Before the engine reports ready, run a few requests that compile every Triton kernel
    # specialization serving can reach (engine/runtime/warmup.py; CUDA only).
    enable_warmup: bool = True
    # Graph capture first finds the Triton kernels it needs, then compiles them on a thread
    # pool (engine/kernels/precompile.py): an empty Triton cache costs seconds of start-up, not tens.
    parallel_compile: bool = True
    # Then move every object alive into the garbage collector's permanent generation, so
    # full collections skip the libraries and weights (engine/runtime/gc_freeze.py). A Serve
    # app's ingress replicas and engine-process parents follow this setting too.
    freeze_gc_after_start: bool = field(default_factory=lambda: _gc_freeze_default())
    # Decode attention reads a cached prefix shared by several running requests once for
    # all of them (Triton backend; engine/core/prefix_groups.py), when it is at least this long.
    enable_prefix_grouped_decode: bool = True
    prefix_group_min_tokens: int = 256
    # Kernel paths to switch off for A/B runs (a mapping of its fields is accepted).
    kernels: KernelConfig = field(default_factory=KernelConfig)

    # Parallelism
    tp_size: int = 1  # tensor-parallel ranks (rank 0 schedules and samples; see engine/executor/distributed.py)
    dist_timeout_s: float = 300.0  # a collective or rank start-up taking longer fails (dead/hung rank)
    # MoE models at tp > 1: "tp" gives every rank a slice of each expert's width, "ep" gives
    # each rank whole experts (engine/layers/moe.py); either way one all-reduce per layer.
    moe_parallel: Literal["tp", "ep"] = "tp"

    # Structured output
    grammar_backend: Literal["xgrammar", "llguidance", "none"] = "xgrammar"
    enable_jump_forward: bool = True

    # Router support: record radix-cache insert/evict events for a replica's cache digest.
    enable_cache_events: bool = False

    # Speculative decoding (engine/speculative/): drafts verified by one target forward.
    # None = off. "ngram" drafts from the request's own prompt + output (prompt lookup);
    # "draft_model" drafts with `speculative_draft_model` (a smaller model with the same
    # vocabulary; its own KV pool of as many slots as the target's, and its own CUDA graphs).
    # Turns overlap scheduling off; requests it cannot serve decode plainly. On a GPU with
    # CUDA graphs, steps whose verify forward would fit no extend graph (more running
    # requests than cuda_graph_max_extend_bs) decode plainly: an eager verify step costs
    # several plain steps.
    speculative_algorithm: Literal["ngram", "draft_model"] | None = None
    speculative_draft_model: str | None = None
    speculative_num_steps: int = 4  # draft-model forwards per step (draft_model only)
    # Max draft tokens per request per step (draft_model: at most num_steps of them).
    speculative_num_draft_tokens: int = 4
    speculative_ngram_min_match: int = 1  # shortest suffix n-gram looked up
    speculative_ngram_max_match: int = 3  # longest suffix n-gram looked up (tried first)

    # LoRA adapters (engine/lora/): PEFT adapters served beside the base model, chosen per
    # request (`SamplingParams.lora`). `lora_modules` ({name: path}) registers them at
    # start; `enable_lora` reserves the GPU pool without any (adapters load at runtime).
    enable_lora: bool = False
    lora_modules: dict[str, str] | None = None
    max_loras: int = 4  # adapters in the GPU pool (LRU; one step batches at most this many)
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None  # adapter weights kept in host memory (None: all)
    # Where an adapter named in a request but not registered is looked for (`<dir>/<name>`).
    lora_dynamic_path: str | None = None

    def __post_init__(self) -> None:
        self.kernels = KernelConfig.of(self.kernels)
        _check_field_types(self)
        if self.dtype not in DTYPES + ("auto",):
            raise ValueError(f"dtype must be one of {DTYPES + ('auto',)}, got {self.dtype!r}")
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(f"load_format must be 'safetensors' or 'dummy', got {self.load_format!r}")
        if self.task not in ("generate", "embed", "score"):
            raise ValueError(f"task must be 'generate', 'embed' or 'score', got {self.task!r}")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.max_total_tokens is not None and self.max_total_tokens < 2:
            raise ValueError("max_total_tokens must be >= 2")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError("mem_fraction_static must be in (0, 1)")
        if self.cuda_graph_max_extend_bs is None:
            self.cuda_graph_max_extend_bs = 64 if self.speculative_algorithm else 16
        if self.cuda_graph_max_extend_tokens < 0 or self.cuda_graph_max_extend_bs < 1:
            raise ValueError("cuda_graph_max_extend_tokens must be >= 0 (0 disables) and "
                             "cuda_graph_max_extend_bs >= 1")
        if self.prefix_group_min_tokens < 1:
            raise ValueError("prefix_group_min_tokens must be >= 1")
        if self.tp_size < 1:
            raise ValueError("tp_size must be >= 1")
        if self.dist_timeout_s <= 0:
            raise ValueError("dist_timeout_s must be > 0")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be None or 'fp8', got {self.quantization!r}")
        if self.kv_cache_dtype not in ("auto", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8_e4m3', got {self.kv_cache_dtype!r}")
        if self.moe_parallel not in ("tp", "ep"):
            raise ValueError(f"moe_parallel must be 'tp' or 'ep', got {self.moe_parallel!r}")
        if self.priority_scheduling not in ("preempt", "order", "off"):
            raise ValueError("priority_scheduling must be 'preempt', 'order' or 'off', "
                             f"got {self.priority_scheduling!r}")
        if self.max_queue_time_s is not None and not 0 < self.max_queue_time_s < float("inf"):
            raise ValueError(f"max_queue_time_s must be a positive number or None, got {self.max_queue_time_s!r}")
        if self.prefill_attention_backend not in ("auto", "triton", "flashinfer"):
            raise ValueError("prefill_attention_backend must be 'auto', 'triton' or 'flashinfer', "
                             f"got {self.prefill_attention_backend!r}")
        self._validate_host_tier()
        self._validate_speculative()
        self._validate_lora()

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules) or self.lora_dynamic_path is not None

    def _validate_lora(self) -> None:
        if not isinstance(self.lora_modules, (dict, type(None))):
            raise ValueError("lora_modules must map adapter names to paths, "
                             f"got {self.lora_modules!r}")
        if self.max_loras < 1 or not 1 <= self.max_lora_rank <= 512:
            raise ValueError("max_loras must be >= 1 and max_lora_rank within 1-512")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be >= max_loras (or None)")
        if not self.lora_enabled:
            return
        for other, why in ((self.tp_size > 1, "tp_size > 1"),
                           (self.speculative_algorithm, "speculative decoding"),
                           (self.quantization, "quantization")):
            if other:
                raise ValueError(f"LoRA adapters are not supported with {why}")

    def _validate_host_tier(self) -> None:
        if not 0 <= self.host_kv_cache_gb < float("inf"):
            raise ValueError(f"host_kv_cache_gb must be >= 0, got {self.host_kv_cache_gb!r}")
        if self.host_kv_write_back not in ("lazy", "eager"):
            raise ValueError(f"host_kv_write_back must be 'lazy' or 'eager', got {self.host_kv_write_back!r}")
        if self.host_kv_cache_gb and not self.enable_radix_cache:
            raise ValueError("host_kv_cache_gb needs enable_radix_cache (the tier keeps the tree's KV)")
        if self.host_kv_cache_gb and self.tp_size > 1:
            raise ValueError("host_kv_cache_gb is not supported at tp_size > 1 yet")

    def _validate_speculative(self) -> None:
        algo = self.speculative_algorithm
        if algo not in (None, "ngram", "draft_model"):
            raise ValueError(f"speculative_algorithm must be None, 'ngram' or 'draft_model', got {algo!r}")
        if self.speculative_num_draft_tokens < 1 or self.speculative_num_steps < 1:
            raise ValueError("speculative_num_draft_tokens and speculative_num_steps must be >= 1")
        if not 1 <= self.speculative_ngram_min_match <= self.speculative_ngram_max_match:
            raise ValueError("need 1 <= speculative_ngram_min_match <= speculative_ngram_max_match")
        if algo == "draft_model" and not self.speculative_draft_model:
            raise ValueError("speculative_algorithm='draft_model' needs speculative_draft_model")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine setting(s): {', '.join(unknown)}")
        return cls(**kwargs)


# What a field of each declared type accepts. bool is an int in Python and YAML's `"false"`
# is a non-empty string: without this, `enable_cuda_graph: "false"` would switch graphs on
# and `max_running_requests: true` would mean 1, silently.
# (numbers' ABCs: numpy's integers, from GGUF metadata say, count as ints.)
_ACCEPTS = {bool: (bool,), int: (numbers.Integral,), float: (numbers.Real,), str: (str,)}


def _check_field_types(config: EngineConfig | KernelConfig, prefix: str = "") -> None:
    """Raise ValueError naming the first field whose value is not of its declared type
    (bool, int, float or str, optionally None; Literal fields have their own checks)."""
    for name, declared, optional in _simple_fields(type(config)):
        value = getattr(config, name)
        if value is None and optional:
            continue
        kinds = _ACCEPTS[declared]
        if not isinstance(value, kinds) or (isinstance(value, bool) and declared is not bool):
            expected = declared.__name__ + (" or None" if optional else "")
            raise ValueError(f"{prefix}{name} must be {expected}, got {value!r} ({type(value).__name__})")


@functools.cache
def _simple_fields(cls: type) -> tuple[tuple[str, type, bool], ...]:
    """(name, declared type, None allowed) of every bool/int/float/str field of `cls`."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        args = typing.get_args(hint) if union else (hint,)
        base = [a for a in args if a is not type(None)]
        if len(base) == 1 and base[0] in _ACCEPTS:
            out.append((f.name, base[0], type(None) in args))
    return tuple(out)
