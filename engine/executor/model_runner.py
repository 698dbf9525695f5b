"""Owns the model, the KV pool and the request-to-token table, and runs each step's
forward: rank 0 turns a StepPlan into a packed step (engine/executor/batch_builder.py), sends it to
the other ranks at tp > 1, and every rank uploads it (engine/executor/staging.py), writes its
req_to_token entries and runs the model (a CUDA graph where one fits)."""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from engine.kernels.launch import apply_kernel_config
from engine.attention.base import ForwardBatch, leading_decode_rows
from engine.executor.batch_builder import build_step
from engine.config import EngineConfig
from engine.executor.distributed import CMD_FORWARD
from engine.executor.graph_inputs import takes_packed
from engine.attention.kv_pool import KVPool
from engine.layers import set_fused_kernels
from engine.layers.parallel import TPContext
from engine.loading.hf_config import load_hf_config, resolve_device, resolve_dtype
from engine.loading.hf_shapes import attention_scale, head_dim_of, is_mla_config
from engine.executor.kv_sizing import MemoryReserve, kv_shape, v_head_dim
from engine.executor.prompt_logprobs import PromptScores, PromptTargets
from engine.quantization.fp8 import FP8
from engine.layers.fp8 import set_fast_accum_
from engine.executor.staging import PinnedUploader
from engine.executor.step_input import PackedStep, PendingTokens, StepInput
from engine.core.step_plan import StepPlan
from engine.executor.startup_timer import StartupTimer

logger = logging.getLogger(__name__)

_CPU_DEFAULT_SLOTS = 16384


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPContext | None = None,
                 reserve: MemoryReserve | None = None, *,
                 load_model: Callable[..., nn.Module]) -> None:
        """`load_model`: engine/models/__init__.py's, handed in by who builds the runner (the
        engine, a TP worker), so the executor stands below the model registry."""
        self.config = config
        self.load_model = load_model
        self.reserve = reserve or MemoryReserve()
        self.startup = StartupTimer()  # per-phase start time (engine/runtime/warmup.py)
        self.tp = tp or TPContext()
        if self.tp.size != config.tp_size:
            raise ValueError(f"tp_size={config.tp_size} needs its ranks started and joined first "
                             "(LLM starts local processes; the Serve app, Ray actors)")
        self.hf_config = load_hf_config(config.model)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.hf_config, self.device)
        torch.manual_seed(config.seed)
        apply_kernel_config(config.kernels)  # before any launch: engine/kernels/launch.py
        self._flashinfer_load = self._start_flashinfer_load()  # beside the weight load
        self.model = load_model(config.model, dtype=self.dtype, device=self.device,
                                load_format=config.load_format, seed=config.seed, tp=self.tp,
                                hf_config=self.hf_config, moe_parallel=config.moe_parallel,
                                quantization=config.quantization)
        set_fast_accum_(self.model, config.fp8_fast_accum)
        set_fused_kernels(self.model, config.enable_fused_kernels and self.device.type == "cuda",
                          config.kernels)
        self.lora = self._make_lora()  # before the KV pool: its slots take memory first
        self.startup.mark("load")
        self.vocab_size = self.hf_config.vocab_size
        self.max_context = config.max_model_len or self.hf_config.max_position_embeddings
        self.kv_pool = self._make_kv_pool()
        self.startup.mark("kv_pool")
        # Row r holds the slots of running request r's tokens; row 0 is for padding.
        self.req_to_token = torch.zeros((config.max_running_requests + 1, self.max_context),
                                        dtype=torch.int32, device=self.device)
        self.attn_backend = self._make_attention_backend()
        self.model.set_attention_backend(self.attn_backend)
        self._add_flashinfer_prefill()  # its thread done before the capture's Python-bound work
        self.uploader = PinnedUploader(self.device)
        self.prefix_grouper = self._make_prefix_grouper()
        self.graphs = self._make_graphs()
        self.group_metadata = self._make_group_metadata()
        self.capture_times = self._capture_graphs()
        self.startup.mark("cuda_graphs")

    def _make_lora(self):
        if not self.config.lora_enabled:
            return None
        from engine.lora import LoRAManager

        return LoRAManager(self.config, self.model, self.device, self.dtype)

    def _capture_graphs(self) -> dict:
        """Decode graphs first, then the extend graphs in the same memory pool; the Triton
        kernels of both compiled ahead in parallel (engine/kernels/precompile.py)."""
        if self.graphs is None:
            return {}
        from engine.executor.graph_capture import capture_all

        return capture_all(self.graphs, self.config.parallel_compile)

    def _make_graphs(self):
        """CUDA graphs for decode steps and short prefill/extend steps
        (engine/executor/graph_runner.py)."""
        if not (self.config.enable_cuda_graph and self.device.type == "cuda"):
            return None
        from engine.executor.graph_runner import GraphRunner

        max_bs = min(self.config.cuda_graph_max_bs, self.config.max_running_requests)
        return GraphRunner(self.model, self.attn_backend, self.req_to_token, max_bs,
                           extend=self._extend_graph_limits(),
                           grouped=self.prefix_grouper is not None)

    def _extend_graph_limits(self) -> tuple[int, int] | None:
        """(new tokens, requests) the extend graphs may hold; None: no extend graphs."""
        cfg = self.config
        if not (cfg.cuda_graph_max_extend_tokens > 0
                and getattr(self.attn_backend, "supports_extend_graphs", True)):
            return None
        # capture runs one request over the largest bucket: its positions must fit the
        # context (req_to_token's width, the RoPE table)
        max_tokens = min(cfg.cuda_graph_max_extend_tokens, self.max_context)
        return max_tokens, min(cfg.cuda_graph_max_extend_bs, cfg.max_running_requests)

    def _make_prefix_grouper(self):
        """Radix-grouped decode (engine/core/prefix_groups.py), when the backend runs it."""
        cfg = self.config
        if not (cfg.enable_prefix_grouped_decode and cfg.enable_radix_cache
                and getattr(self.attn_backend, "supports_prefix_groups", False)):
            return None
        from engine.core.prefix_groups import PrefixGrouper

        group = max(1, self.q_heads // self._kv_shape()[1])
        return PrefixGrouper(cfg.prefix_group_min_tokens,
                             self.attn_backend.prefix_members_per_tile(group))

    def _make_group_metadata(self):
        if self.prefix_grouper is None:
            return None
        from engine.executor.group_metadata import GroupMetadata

        return GroupMetadata(self.prefix_grouper, self.graphs, self.attn_backend.prefix_num_splits)

    # -- setup --------------------------------------------------------------------------

    def _kv_shape(self) -> tuple[int, int, int]:
        return kv_shape(self.hf_config, self.tp.size)

    @property
    def q_heads(self) -> int:
        """Query heads of this rank's attention."""
        return max(1, self.hf_config.num_attention_heads // self.tp.size)

    def _make_kv_pool(self) -> KVPool:
        layers, kv_heads, head_dim = self._kv_shape()
        kv_dtype = self._kv_dtype()
        v_dim = v_head_dim(self.hf_config)
        per_token = KVPool.bytes_per_token(layers, kv_heads, head_dim, kv_dtype, v_dim)
        num_slots = self.config.max_total_tokens
        if num_slots is None:
            # Ranks' free memory differs; all must hold the same slots, so take the least.
            num_slots = self.tp.min_over_ranks(self._slots_from_memory(per_token))
        logger.info("KV pool: %d slots (%.1f MiB)", num_slots, num_slots * per_token / 2**20)
        return KVPool(num_slots, layers, kv_heads, head_dim, kv_dtype, self.device,
                      v_head_dim=v_dim)

    def _slots_from_memory(self, per_token: int) -> int:
        if self.device.type != "cuda":
            return _CPU_DEFAULT_SLOTS
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        budget = total * self.config.mem_fraction_static - used - self.reserve.fixed_bytes
        per_token += self.reserve.bytes_per_token
        if budget <= per_token * 1024:
            draft = self.reserve.fixed_bytes / 2**30
            raise ValueError(f"mem_fraction_static={self.config.mem_fraction_static} leaves no "
                             f"room for the KV cache ({used / 2**30:.1f} GiB already in use"
                             + (f", {draft:.1f} GiB kept for a draft model)" if draft else ")"))
        return int(budget // per_token)

    def _kv_dtype(self) -> torch.dtype:
        return FP8 if self.config.kv_cache_dtype == "fp8_e4m3" else self.dtype

    def _attention_backend_name(self) -> str:
        name = self.config.attention_backend
        if name == "auto":
            name = "triton" if self.device.type == "cuda" else "torch"
        return name

    def _make_attention_backend(self):
        name = self._attention_backend_name()
        if is_mla_config(self.hf_config):
            from engine.attention.mla_backend import MLABackend

            graphs = self.config.enable_cuda_graph and self.device.type == "cuda"
            return MLABackend(self.kv_pool, self.hf_config.kv_lora_rank,
                              triton_decode=name == "triton", graph_mode=graphs)
        scale = attention_scale(self.hf_config)
        prefill = self.config.prefill_attention_backend
        if prefill == "flashinfer" and name != "triton":
            raise ValueError("prefill_attention_backend='flashinfer' needs the Triton attention "
                             f"backend (a CUDA GPU); this engine attends with {name!r}")
        if name == "triton":
            from engine.attention.triton_backend import TritonAttentionBackend

            graphs = self.config.enable_cuda_graph and self.device.type == "cuda"
            return TritonAttentionBackend(self.kv_pool, scale, graph_mode=graphs,
                                          decode_stores_kv=self.config.kernels.decode_stores_kv)
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(self.kv_pool, scale)

    def _start_flashinfer_load(self):
        """FlashInfer's Hopper prefill for large extend steps, when asked for (its kernel
        built here, or loaded from its cache) or ("auto") when it can serve: its import and
        kernel load (seconds of host work) start on a thread while the weights load
        (engine/attention/flashinfer_prefill.py); None when it will not serve."""
        prefill = self.config.prefill_attention_backend
        if prefill == "triton" or self._attention_backend_name() != "triton":
            return None
        if is_mla_config(self.hf_config):
            if prefill == "flashinfer":
                raise ValueError("prefill_attention_backend='flashinfer' does not serve MLA "
                                 "models (DeepSeek); leave it 'auto' or 'triton'")
            return None
        from engine.attention import flashinfer_prefill

        kv_dtype = self._kv_dtype()
        reason = flashinfer_prefill.unavailable_reason(self.device, kv_dtype)
        if reason is not None:
            if prefill == "flashinfer":
                raise ValueError(f"prefill_attention_backend='flashinfer': {reason}")
            return None
        return flashinfer_prefill.start_loading(kv_dtype, head_dim_of(self.hf_config),
                                                build=prefill == "flashinfer")

    def _add_flashinfer_prefill(self) -> None:
        """Hands the backend FlashInfer's prefill once its background load is done. Joined
        before the CUDA-graph capture: in the one start measured with the load (~12 s of
        Python: FlashInfer's import and JIT spec) beside the capture, the capture took 18.3 s
        against 11.3-13.3 s on other H200 machines (one GIL)."""
        if self._flashinfer_load is None:
            return
        from engine.attention import flashinfer_prefill

        try:
            loaded_s = self._flashinfer_load.result()
            if loaded_s is not None:
                kv_heads, head_dim = self.kv_pool.k[0].shape[1:]
                self.attn_backend.use_flashinfer_prefill(flashinfer_prefill.FlashInferPrefill(
                    self.device, self.attn_backend.scale, self.q_heads, kv_heads, head_dim,
                    self.kv_pool.k[0].dtype))
        except Exception as e:  # noqa: BLE001 - an optional kernel: on "auto", Triton serves
            if self.config.prefill_attention_backend == "flashinfer":
                raise
            logger.warning("prefill attention: FlashInfer is installed but its kernel could not "
                           "be built (%s: %s); large prefill steps stay on Triton",
                           type(e).__name__, e)
            return
        finally:
            waited_s = self.startup.mark("flashinfer")
        if loaded_s is None:
            logger.info("prefill attention: Triton. FlashInfer is installed but its kernel for "
                        "this model is not built, or its build is not current, on this machine; "
                        "prefill_attention_backend=flashinfer builds it at start-up (about 2 "
                        "minutes, once: it is cached), docs/deploy.md says how to bake it into "
                        "an image")
            return
        logger.info("prefill attention: FlashInfer fa3 for large extend steps (loaded in %.1fs "
                    "beside the weights, then %.1fs more)", loaded_s, waited_s)

    # -- per step -----------------------------------------------------------------------

    def build_batch(self, plan: StepPlan) -> ForwardBatch:
        """The plan as a ragged device batch (brings device rows up to date)."""
        return self._make_batch(build_step(plan, [], None, self.group_metadata), None)[0]

    def _make_batch(self, step: PackedStep, pending_tokens: torch.Tensor | None
                    ) -> tuple[ForwardBatch, torch.Tensor]:
        """Upload the step, apply its req_to_token updates, read its in-flight input tokens
        from `pending_tokens`; the batch and the prompt rows."""
        s = StepInput.unpack(self.uploader.upload(step.flat), step.lengths)
        if s.sync_rows.numel():
            self.req_to_token[s.sync_rows, s.sync_cols] = s.sync_slots.to(torch.int32)
        input_ids = s.input_ids
        if s.inflight_pos.numel():
            input_ids = input_ids.index_put((s.inflight_pos,), pending_tokens[s.inflight_src])
        batch = ForwardBatch(
            input_ids=input_ids, positions=s.positions, out_slots=s.out_slots,
            req_rows=s.req_rows, seq_lens=s.seq_lens.to(torch.int32),
            extend_lens=s.extend_lens.to(torch.int32), qo_indptr=s.qo_indptr.to(torch.int32),
            logits_indices=s.logits_indices, req_to_token=self.req_to_token,
            is_decode=step.is_decode, seq_lens_cpu=step.seq_lens, extend_lens_cpu=step.extend_lens,
            decode_rows=0 if step.is_decode else leading_decode_rows(step.extend_lens))
        if s.prefix_groups.numel():
            from engine.executor.prefix_group_batch import PrefixGroupBatch

            batch.prefix_groups = PrefixGroupBatch.from_packed(
                s.prefix_groups, step.host("prefix_groups"), step.seq_lens)
        return batch, s.prompt_rows

    @torch.inference_mode()
    def forward(self, plan: StepPlan, pending: PendingTokens | None = None
                ) -> tuple[torch.Tensor, PromptScores]:
        """Logits [num_chunks, vocab] (float32) of each chunk's last new token (of every
        position of a chunk with a draft, in order: 1 + len(draft) rows), and the
        prompt-token logprobs the step's requests asked for, still on the device
        (`PromptScores.resolve()`: (request, position, value, top) rows, `top` the position's
        params.top_logprobs best (token, logprob) or None).
        At tp > 1 (this is rank 0) the other ranks get the step first and run it alongside.
        `pending`: the in-flight step's tokens, some of which are this step's inputs
        (overlap scheduling, tp 1 only)."""
        targets = PromptTargets.of(plan)
        if self.lora is not None:
            self.lora.prepare(plan)
        step = build_step(plan, targets.rows, pending, self.group_metadata)
        if self.tp.size > 1:
            self.tp.send_step(CMD_FORWARD, step)
        logits, prompt_logits = self.execute(step, pending.tokens if pending else None)
        if prompt_logits is None:
            return logits, PromptScores([], [])
        return logits, targets.scores(prompt_logits)

    @torch.inference_mode()
    def execute(self, step: PackedStep, pending_tokens: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's forward, the same on every rank: logits of the rows the step needs
        (`logits_indices`: each chunk's last token, every position of a draft), and of the
        prompt rows (None without them). Decode steps and short extends replay CUDA graphs."""
        graphs = self.graphs
        if graphs is not None and step.is_decode and len(step.seq_lens) <= graphs.max_bs \
                and takes_packed(step.lengths):
            flat = self.uploader.upload(step.flat)
            return graphs.run_packed(flat, step.lengths, pending_tokens), None
        batch, prompt_rows = self._make_batch(step, pending_tokens)
        has_prompt_rows = prompt_rows.numel() > 0  # (decode graphs compute no prompt rows)
        if graphs is not None and not has_prompt_rows and graphs.fits_decode(batch):
            return graphs.run_decode(batch), None
        if graphs is not None and graphs.fits_extend(batch):
            hidden = graphs.run_extend(batch)
        else:
            self.attn_backend.prepare(batch)
            hidden = self.model(batch)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        if not has_prompt_rows:
            return logits, None
        return logits, self.model.compute_logits(hidden[prompt_rows])

    def close(self) -> None:
        """At tp > 1: stop the other ranks and leave the process groups."""
        if self.tp.size > 1:
            self.tp.shutdown()
