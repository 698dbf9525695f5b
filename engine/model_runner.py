"""Owns the model, the KV pool and the request-to-token table; turns a StepPlan into
batch tensors and runs the forward."""
from __future__ import annotations

import logging

import torch

from engine.attention.base import ForwardBatch
from engine.config import EngineConfig
from engine.kv_pool import KVPool
from engine.layers.parallel import TPContext
from engine.models import load_hf_config, load_model, resolve_device, resolve_dtype
from engine.models.llama import head_dim_of
from engine.request import Request
from engine.scheduler import StepPlan

logger = logging.getLogger(__name__)

_CPU_DEFAULT_SLOTS = 16384


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPContext | None = None) -> None:
        self.config = config
        self.tp = tp or TPContext()
        self.hf_config = load_hf_config(config.model)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.hf_config, self.device)
        torch.manual_seed(config.seed)
        self.model = load_model(config.model, dtype=self.dtype, device=self.device,
                                load_format=config.load_format, seed=config.seed, tp=self.tp,
                                hf_config=self.hf_config)
        self.vocab_size = self.hf_config.vocab_size
        self.max_context = config.max_model_len or self.hf_config.max_position_embeddings
        self.kv_pool = self._make_kv_pool()
        # Row r holds the slots of running request r's tokens; row 0 is for padding.
        self.req_to_token = torch.zeros((config.max_running_requests + 1, self.max_context),
                                        dtype=torch.int32, device=self.device)
        self.attn_backend = self._make_attention_backend()
        self.model.set_attention_backend(self.attn_backend)
        # A ring of pinned staging buffers, each reused only after its copy completed.
        self._staging = [torch.empty(0, dtype=torch.long) for _ in range(4)]
        self._staging_done: list = [None] * 4
        self._uploads = 0
        self.placeholder_tokens: torch.Tensor | None = None  # set by the overlap scheduler
        self.graphs = self._capture_graphs()

    def _capture_graphs(self):
        if not (self.config.enable_cuda_graph and self.device.type == "cuda"):
            return None
        from engine.cuda_graph import DecodeGraphs

        max_bs = min(self.config.cuda_graph_max_bs, self.config.max_running_requests)
        return DecodeGraphs(self.model, self.attn_backend, self.req_to_token, max_bs)

    # -- setup --------------------------------------------------------------------------

    def _kv_shape(self) -> tuple[int, int, int]:
        cfg = self.hf_config
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        local_kv_heads = max(1, kv_heads // self.tp.size)
        return cfg.num_hidden_layers, local_kv_heads, head_dim_of(cfg)

    def _make_kv_pool(self) -> KVPool:
        layers, kv_heads, head_dim = self._kv_shape()
        per_token = KVPool.bytes_per_token(layers, kv_heads, head_dim, self.dtype)
        num_slots = self.config.max_total_tokens or self._slots_from_memory(per_token)
        logger.info("KV pool: %d slots (%.1f MiB)", num_slots, num_slots * per_token / 2**20)
        return KVPool(num_slots, layers, kv_heads, head_dim, self.dtype, self.device)

    def _slots_from_memory(self, per_token: int) -> int:
        if self.device.type != "cuda":
            return _CPU_DEFAULT_SLOTS
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        budget = total * self.config.mem_fraction_static - used
        if budget <= per_token * 1024:
            raise ValueError(f"mem_fraction_static={self.config.mem_fraction_static} leaves no "
                             f"room for the KV cache ({used / 2**30:.1f} GiB already in use)")
        return int(budget // per_token)

    def _make_attention_backend(self):
        name = self.config.attention_backend
        if name == "auto":
            name = "triton" if self.device.type == "cuda" else "torch"
        scale = head_dim_of(self.hf_config) ** -0.5
        if name == "triton":
            from engine.attention.triton_backend import TritonAttentionBackend

            graphs = self.config.enable_cuda_graph and self.device.type == "cuda"
            return TritonAttentionBackend(self.kv_pool, scale, graph_mode=graphs)
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(self.kv_pool, scale)

    # -- per step -----------------------------------------------------------------------

    def build_batch(self, plan: StepPlan) -> ForwardBatch:
        """Flatten the plan's chunks into one ragged batch; bring device rows up to date."""
        ids, positions, out_slots = [], [], []
        rows, seq_lens, extend_lens, logits_idx = [], [], [], []
        sync_rows, sync_cols, sync_slots = [], [], []
        if plan.is_decode:
            return self._build_decode_batch(plan)
        t = 0
        for chunk in plan.chunks:
            req, start, n = chunk.req, chunk.start, chunk.num_tokens
            end = start + n
            ids += req.token_ids[start:end]
            positions += range(start, end)
            out_slots += req.slots[start:end]
            if req.row_synced < end:
                sync_rows += [req.row] * (end - req.row_synced)
                sync_cols += range(req.row_synced, end)
                sync_slots += req.slots[req.row_synced:end]
                req.row_synced = end
            rows.append(req.row)
            seq_lens.append(end)
            extend_lens.append(n)
            t += n
            logits_idx.append(t - 1)
        self._sync_rows(sync_rows, sync_cols, sync_slots)
        return self._make_batch(ids, positions, out_slots, rows, seq_lens, extend_lens,
                                logits_idx, is_decode=False)

    def _build_decode_batch(self, plan: StepPlan) -> ForwardBatch:
        """The common case, kept lean: one new token per request."""
        reqs = [c.req for c in plan.chunks]
        seq_lens = [len(r.slots) for r in reqs]
        out_slots = [r.slots[-1] for r in reqs]
        stale = [r for r in reqs if r.row_synced < len(r.slots) - 1]
        if stale:  # rows touched since their last step (e.g. a prefix swapped for the tree's)
            self._sync_rows(*_row_updates(stale))
        for r in reqs:
            r.row_synced = len(r.slots)
        n = len(reqs)
        return self._make_batch(
            [r.token_ids[-1] for r in reqs], [s - 1 for s in seq_lens], out_slots,
            [r.row for r in reqs], seq_lens, [1] * n, list(range(n)), is_decode=True,
            extra_sync=(([r.row for r in reqs], [s - 1 for s in seq_lens], out_slots)))

    def _make_batch(self, ids, positions, out_slots, rows, seq_lens, extend_lens, logits_idx,
                    is_decode: bool, extra_sync=None) -> ForwardBatch:
        qo_indptr = [0]
        for n in extend_lens:
            qo_indptr.append(qo_indptr[-1] + n)
        sync = extra_sync or ([], [], [])
        (input_ids, positions_t, out_slots_t, rows_t, seq_lens_t, extend_lens_t, qo_indptr_t,
         logits_t, sync_rows, sync_cols, sync_slots) = self._upload(
            [ids, positions, out_slots, rows, seq_lens, extend_lens, qo_indptr, logits_idx, *sync])
        if sync[0]:
            self.req_to_token[sync_rows, sync_cols] = sync_slots.to(torch.int32)
        if self.placeholder_tokens is not None and self.placeholder_tokens.numel():
            # Overlap scheduling: -(k+1) stands for row k of the in-flight step's tokens.
            index = (-input_ids - 1).clamp(0, self.placeholder_tokens.numel() - 1)
            input_ids = torch.where(input_ids < 0, self.placeholder_tokens[index], input_ids)
        return ForwardBatch(
            input_ids=input_ids, positions=positions_t, out_slots=out_slots_t, req_rows=rows_t,
            seq_lens=seq_lens_t.to(torch.int32), extend_lens=extend_lens_t.to(torch.int32),
            qo_indptr=qo_indptr_t.to(torch.int32), logits_indices=logits_t,
            req_to_token=self.req_to_token, is_decode=is_decode, seq_lens_cpu=seq_lens,
            extend_lens_cpu=extend_lens)

    def _sync_rows(self, rows: list[int], cols: list[int], slots: list[int]) -> None:
        """Write slot indices into req_to_token[rows, cols] in one scatter."""
        if rows:
            rows_t, cols_t, slots_t = self._upload([rows, cols, slots])
            self.req_to_token[rows_t, cols_t] = slots_t.to(torch.int32)

    def _upload(self, fields: list[list[int]]) -> list[torch.Tensor]:
        """Int lists -> int64 tensors on the device, in one host-to-device copy through a
        reused pinned buffer (many small pinned allocations and copies cost more than the
        decode step itself)."""
        lengths = [len(f) for f in fields]
        flat = torch.tensor([v for f in fields for v in f], dtype=torch.long)
        if self.device.type == "cuda":
            slot = self._uploads % len(self._staging)
            self._uploads += 1
            if self._staging_done[slot] is not None:
                self._staging_done[slot].synchronize()
            if self._staging[slot].numel() < flat.numel():
                self._staging[slot] = torch.empty(2 * flat.numel(), dtype=torch.long, pin_memory=True)
            staging = self._staging[slot][:flat.numel()]
            staging.copy_(flat)
            flat = staging.to(self.device, non_blocking=True)
            self._staging_done[slot] = torch.cuda.Event()
            self._staging_done[slot].record()
        return list(flat.split(lengths))

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> tuple[torch.Tensor, list[tuple[Request, int, float]]]:
        """Logits [num_chunks, vocab] (float32) of each chunk's last new token, and the
        prompt-token logprobs the step's requests asked for, as (request, position, value)."""
        batch = self.build_batch(plan)
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch), []
        self.attn_backend.prepare(batch)
        hidden = self.model(batch)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        return logits, self._prompt_logprobs(plan, hidden)

    def _prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor) -> list[tuple[Request, int, float]]:
        rows, targets, owners = [], [], []
        t = 0
        for chunk in plan.chunks:
            req, first = chunk.req, chunk.req.prompt_logprobs_from
            if first is not None:
                # Logits at position p score the prompt token at p + 1.
                for p in range(max(chunk.start, first - 1),
                               min(chunk.start + chunk.num_tokens, req.num_prompt - 1)):
                    rows.append(t + p - chunk.start)
                    targets.append(req.token_ids[p + 1])
                    owners.append((req, p + 1))
            t += chunk.num_tokens
        if not rows:
            return []
        logprobs = torch.log_softmax(self.model.compute_logits(hidden[rows]), dim=-1)
        index = torch.tensor(targets, device=logprobs.device).unsqueeze(1)
        values = logprobs.gather(1, index).squeeze(1).tolist()
        return [(req, pos, v) for (req, pos), v in zip(owners, values)]


def _row_updates(reqs) -> tuple[list[int], list[int], list[int]]:
    """(rows, cols, slots) bringing each request's row up to all but its newest slot."""
    rows, cols, slots = [], [], []
    for r in reqs:
        end = len(r.slots) - 1
        rows += [r.row] * (end - r.row_synced)
        cols += range(r.row_synced, end)
        slots += r.slots[r.row_synced:end]
    return rows, cols, slots
