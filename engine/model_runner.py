"""Owns the model, the KV pool and the request-to-token table; turns a StepPlan into
batch tensors and runs the forward."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention.base import ForwardBatch
from engine.config import EngineConfig
from engine.distributed import CMD_FORWARD
from engine.kv_pool import KVPool
from engine.layers import set_fused_kernels
from engine.layers.parallel import TPContext
from engine.models import load_hf_config, load_model, resolve_device, resolve_dtype
from engine.models.llama import head_dim_of
from engine.quantization.fp8 import FP8
from engine.request import Request
from engine.step_plan import StepPlan
from engine.warmup import StartupTimer

logger = logging.getLogger(__name__)

_CPU_DEFAULT_SLOTS = 16384

# The fields of one step's packed int64 tensor, in order (what rank 0 broadcasts at tp > 1).
FIELDS = ("input_ids", "positions", "out_slots", "req_rows", "seq_lens", "extend_lens",
          "qo_indptr", "logits_indices", "sync_rows", "sync_cols", "sync_slots", "prompt_rows",
          "prefix_groups", "inflight_pos", "inflight_src")
_SEQ_LENS, _EXTEND_LENS, _SYNC_ROWS, _PROMPT_ROWS, _PREFIX_GROUPS, _INFLIGHT_POS = (
    FIELDS.index(f) for f in ("seq_lens", "extend_lens", "sync_rows", "prompt_rows",
                              "prefix_groups", "inflight_pos"))


@dataclass
class PendingTokens:
    """Tokens a launched step sampled that the host has not seen yet (overlap scheduling):
    `tokens` [k] on the device; `index[req]` is the request's entry in it. The next step
    reads a request's in-flight input token from there."""

    tokens: torch.Tensor
    index: dict[Request, int]


@dataclass
class StepInput:
    """One step's batch: the FIELDS int lists back to back in one int64 host tensor. It is
    everything a rank needs to run the step's forward, so at tp > 1 rank 0 sends exactly
    this to the other ranks."""

    flat: torch.Tensor
    lengths: list[int]
    is_decode: bool
    seq_lens: list[int]  # host copies, read by the attention backend
    extend_lens: list[int]

    @classmethod
    def pack(cls, fields: list[list[int]], is_decode: bool) -> "StepInput":
        flat = torch.tensor([v for f in fields for v in f], dtype=torch.long)
        return cls(flat, [len(f) for f in fields], is_decode, fields[_SEQ_LENS],
                   fields[_EXTEND_LENS])

    @classmethod
    def unpack(cls, flat: torch.Tensor, lengths: list[int], is_decode: bool) -> "StepInput":
        parts = flat.split(lengths)
        return cls(flat, lengths, is_decode, parts[_SEQ_LENS].tolist(),
                   parts[_EXTEND_LENS].tolist())


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPContext | None = None) -> None:
        self.config = config
        self.startup = StartupTimer()  # per-phase start time (engine/warmup.py)
        self.tp = tp or TPContext()
        if self.tp.size != config.tp_size:
            raise ValueError(f"tp_size={config.tp_size} needs its ranks started and joined first "
                             "(LLM starts local processes; the Serve app, Ray actors)")
        self.hf_config = load_hf_config(config.model)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.hf_config, self.device)
        torch.manual_seed(config.seed)
        self.model = load_model(config.model, dtype=self.dtype, device=self.device,
                                load_format=config.load_format, seed=config.seed, tp=self.tp,
                                hf_config=self.hf_config, moe_parallel=config.moe_parallel,
                                quantization=config.quantization)
        set_fused_kernels(self.model, config.enable_fused_kernels and self.device.type == "cuda")
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
        # A ring of pinned staging buffers, each reused only after its copy completed.
        self._staging = [torch.empty(0, dtype=torch.long) for _ in range(4)]
        self._staging_done: list = [None] * 4
        self._uploads = 0
        self.prefix_grouper = self._make_prefix_grouper()
        self.graphs = self._capture_graphs()
        self.extend_graphs = self._capture_extend_graphs()
        self.startup.mark("cuda_graphs")

    def _capture_graphs(self):
        if not (self.config.enable_cuda_graph and self.device.type == "cuda"):
            return None
        from engine.cuda_graph import DecodeGraphs

        max_bs = min(self.config.cuda_graph_max_bs, self.config.max_running_requests)
        return DecodeGraphs(self.model, self.attn_backend, self.req_to_token, max_bs,
                            grouped=self.prefix_grouper is not None)

    def _capture_extend_graphs(self):
        """Graphs for short prefill/extend steps (engine/extend_graphs.py), after the
        decode graphs so both share one memory pool."""
        cfg = self.config
        if not (cfg.enable_cuda_graph and self.device.type == "cuda"
                and cfg.cuda_graph_max_extend_tokens > 0):
            return None
        from engine.extend_graphs import ExtendGraphs

        return ExtendGraphs(self.model, self.attn_backend, self.req_to_token,
                            cfg.cuda_graph_max_extend_tokens,
                            min(cfg.cuda_graph_max_extend_bs, cfg.max_running_requests),
                            pool=self.graphs.pool if self.graphs is not None else None)

    def _make_prefix_grouper(self):
        """Radix-grouped decode (engine/prefix_groups.py), when the backend runs it."""
        cfg = self.config
        if not (cfg.enable_prefix_grouped_decode and cfg.enable_radix_cache
                and getattr(self.attn_backend, "supports_prefix_groups", False)):
            return None
        from engine.prefix_groups import PrefixGrouper

        q_heads = max(1, self.hf_config.num_attention_heads // self.tp.size)
        group = max(1, q_heads // self._kv_shape()[1])
        return PrefixGrouper(cfg.prefix_group_min_tokens,
                             self.attn_backend.prefix_members_per_tile(group))

    # -- setup --------------------------------------------------------------------------

    def _kv_shape(self) -> tuple[int, int, int]:
        cfg = self.hf_config
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        local_kv_heads = max(1, kv_heads // self.tp.size)
        return cfg.num_hidden_layers, local_kv_heads, head_dim_of(cfg)

    def _make_kv_pool(self) -> KVPool:
        layers, kv_heads, head_dim = self._kv_shape()
        kv_dtype = FP8 if self.config.kv_cache_dtype == "fp8_e4m3" else self.dtype
        per_token = KVPool.bytes_per_token(layers, kv_heads, head_dim, kv_dtype)
        num_slots = self.config.max_total_tokens
        if num_slots is None:
            # Ranks' free memory differs; all must hold the same slots, so take the least.
            num_slots = self.tp.min_over_ranks(self._slots_from_memory(per_token))
        logger.info("KV pool: %d slots (%.1f MiB)", num_slots, num_slots * per_token / 2**20)
        return KVPool(num_slots, layers, kv_heads, head_dim, kv_dtype, self.device)

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
        """The plan as a ragged device batch (brings device rows up to date)."""
        return self._make_batch(self._step_input(plan, [], None), None)[0]

    def _step_input(self, plan: StepPlan, prompt_rows: list[int],
                    pending: PendingTokens | None) -> StepInput:
        """Flatten the plan's chunks into one ragged batch, with the req_to_token updates
        it needs (each chunk's row entries from `row_from` on)."""
        if plan.is_decode:
            return self._decode_input(plan, prompt_rows, pending)
        ids, positions, out_slots = [], [], []
        rows, seq_lens, extend_lens, logits_idx = [], [], [], []
        sync_rows, sync_cols, sync_slots = [], [], []
        inflight_pos, inflight_src = [], []
        t = 0
        for chunk in plan.chunks:
            req, start, n = chunk.req, chunk.start, chunk.num_tokens
            end = start + n
            known_end = min(end - len(chunk.draft), len(req.token_ids))
            ids += req.token_ids[start:known_end]
            for _ in range(known_end, end - len(chunk.draft)):  # a token still in flight
                inflight_pos.append(len(ids))
                inflight_src.append(pending.index[req])
                ids.append(0)  # overwritten on the device
            ids += chunk.draft
            positions += range(start, end)
            kv = req.kv
            out_slots += kv.slots[start:end]
            sync_rows += [kv.row] * (end - chunk.row_from)
            sync_cols += range(chunk.row_from, end)
            sync_slots += kv.slots[chunk.row_from:end]
            rows.append(kv.row)
            seq_lens.append(end)
            extend_lens.append(n)
            t += n
            if chunk.draft:  # speculative verification reads every position's logits
                logits_idx += range(t - n, t)
            else:
                logits_idx.append(t - 1)
        return StepInput.pack([ids, positions, out_slots, rows, seq_lens, extend_lens,
                               _indptr(extend_lens), logits_idx, sync_rows, sync_cols, sync_slots,
                               prompt_rows, [], inflight_pos, inflight_src], is_decode=False)

    def _decode_input(self, plan: StepPlan, prompt_rows: list[int],
                      pending: PendingTokens | None) -> StepInput:
        """The common case, kept lean: one new token per request."""
        reqs = [c.req for c in plan.chunks]
        ids = [r.token_ids[-1] for r in reqs]
        inflight_pos, inflight_src = [], []
        if pending is not None:  # overlap scheduling: inputs sampled by the in-flight step
            inflight_pos = [i for i, r in enumerate(reqs) if r.inflight]
            inflight_src = [pending.index[reqs[i]] for i in inflight_pos]
        kvs = [r.kv for r in reqs]
        seq_lens = [len(kv.slots) for kv in kvs]
        out_slots = [kv.slots[-1] for kv in kvs]
        positions = [s - 1 for s in seq_lens]
        rows = [kv.row for kv in kvs]
        sync_rows, sync_cols, sync_slots = rows, positions, out_slots  # each one newest slot
        stale = [c for c in plan.chunks if c.row_from < c.start]
        if stale:  # rows touched since their last step (e.g. a prefix swapped for the tree's)
            old_rows, old_cols, old_slots = _row_updates(stale)
            sync_rows, sync_cols, sync_slots = (old_rows + rows, old_cols + positions,
                                                old_slots + out_slots)
        n = len(reqs)
        return StepInput.pack([ids, positions, out_slots, rows,
                               seq_lens, [1] * n, list(range(n + 1)), list(range(n)),
                               sync_rows, sync_cols, sync_slots, prompt_rows,
                               self._prefix_groups(reqs, seq_lens), inflight_pos, inflight_src],
                              is_decode=True)

    def _prefix_groups(self, reqs, seq_lens: list[int]) -> list[int]:
        """The step's radix-grouped decode metadata (engine/prefix_groups.py), packed for
        the padded size of the graph that runs it; [] for plain decode."""
        if self.prefix_grouper is None:
            return []
        n = len(reqs)
        cap = n
        if self.graphs is not None and n <= self.graphs.max_bs:
            cap = self.graphs.grouped_capacity(n)  # None: a plain graph runs this size
        if cap is None:
            self.prefix_grouper.note_plain(seq_lens)
            return []
        plan = self.prefix_grouper.plan(reqs, seq_lens, cap, self.attn_backend.prefix_num_splits)
        return plan.packed() if plan is not None else []

    def _make_batch(self, step: StepInput, pending_tokens: torch.Tensor | None
                    ) -> tuple[ForwardBatch, torch.Tensor]:
        """Upload the step, apply its req_to_token updates, read its in-flight input tokens
        from `pending_tokens`; the batch and the prompt rows."""
        (input_ids, positions, out_slots, rows, seq_lens, extend_lens, qo_indptr, logits_idx,
         sync_rows, sync_cols, sync_slots, prompt_rows, groups, inflight_pos,
         inflight_src) = self._upload(step.flat).split(step.lengths)
        if step.lengths[_SYNC_ROWS]:
            self.req_to_token[sync_rows, sync_cols] = sync_slots.to(torch.int32)
        if step.lengths[_INFLIGHT_POS]:
            input_ids = input_ids.index_put((inflight_pos,), pending_tokens[inflight_src])
        batch = ForwardBatch(
            input_ids=input_ids, positions=positions, out_slots=out_slots, req_rows=rows,
            seq_lens=seq_lens.to(torch.int32), extend_lens=extend_lens.to(torch.int32),
            qo_indptr=qo_indptr.to(torch.int32), logits_indices=logits_idx,
            req_to_token=self.req_to_token, is_decode=step.is_decode, seq_lens_cpu=step.seq_lens,
            extend_lens_cpu=step.extend_lens)
        if step.lengths[_PREFIX_GROUPS]:
            from engine.prefix_groups import PrefixGroupBatch

            start = sum(step.lengths[:_PREFIX_GROUPS])
            host = step.flat[start:start + step.lengths[_PREFIX_GROUPS]]
            batch.prefix_groups = PrefixGroupBatch.from_packed(groups, host, step.seq_lens)
        return batch, prompt_rows

    def _upload(self, flat: torch.Tensor) -> torch.Tensor:
        """A host int64 tensor on the device, in one host-to-device copy through a reused
        pinned buffer (many small pinned allocations and copies cost more than the decode
        step itself)."""
        if self.device.type != "cuda":
            return flat
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
        return flat

    @torch.inference_mode()
    def forward(self, plan: StepPlan, pending: PendingTokens | None = None
                ) -> tuple[torch.Tensor, list[tuple[Request, int, float, list | None]]]:
        """Logits [num_chunks, vocab] (float32) of each chunk's last new token (of every
        position of a chunk with a draft, in order: 1 + len(draft) rows), and the
        prompt-token logprobs the step's requests asked for, as (request, position, value,
        top): `top` is the position's params.top_logprobs best (token, logprob), or None.
        At tp > 1 (this is rank 0) the other ranks get the step first and run it alongside.
        `pending`: the in-flight step's tokens, some of which are this step's inputs
        (overlap scheduling, tp 1 only)."""
        rows, targets, owners = _prompt_logprob_targets(plan)
        step = self._step_input(plan, rows, pending)
        if self.tp.size > 1:
            self.tp.send_step(CMD_FORWARD, step.is_decode, step.lengths, step.flat)
        logits, prompt_logits = self.execute(step, pending.tokens if pending else None)
        if prompt_logits is None:
            return logits, []
        logprobs = torch.log_softmax(prompt_logits, dim=-1)
        index = torch.tensor(targets, device=logprobs.device).unsqueeze(1)
        values = logprobs.gather(1, index).squeeze(1).tolist()
        return logits, [(req, pos, v, top) for (req, pos), v, top
                        in zip(owners, values, _prompt_top(logprobs, owners))]

    @torch.inference_mode()
    def execute(self, step: StepInput, pending_tokens: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's forward, the same on every rank: logits of each chunk's last token,
        and of the prompt rows (None without them)."""
        batch, prompt_rows = self._make_batch(step, pending_tokens)
        has_prompt_rows = step.lengths[_PROMPT_ROWS] > 0  # (graphs compute no prompt rows)
        if self.graphs is not None and not has_prompt_rows and self.graphs.can_run(batch):
            return self.graphs.run(batch), None
        if self.extend_graphs is not None and not has_prompt_rows and self.extend_graphs.can_run(batch):
            return self.extend_graphs.run(batch), None
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


def _indptr(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _prompt_top(logprobs: torch.Tensor, owners: list[tuple[Request, int]]) -> list[list | None]:
    """Each prompt row's top-k (token, logprob), k = its request's top_logprobs (0: None)."""
    ks = [req.params.top_logprobs for req, _ in owners]
    if not any(ks):
        return [None] * len(owners)
    values, ids = logprobs.topk(max(ks), dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [list(zip(ids[i][:k], values[i][:k])) if k else None for i, k in enumerate(ks)]


def _prompt_logprob_targets(plan: StepPlan) -> tuple[list[int], list[int], list[tuple[Request, int]]]:
    """Rows of the step's hidden states whose logits score a prompt token: (rows, target
    token ids, (request, position) of each)."""
    rows, targets, owners = [], [], []
    t = 0
    for chunk in plan.chunks:
        req = chunk.req
        # (The attribute test first: this runs every step, over every decoding request.)
        first = req.prompt_logprobs_from if req.prompt_logprobs is not None else None
        if first is not None:
            # Logits at position p score the prompt token at p + 1.
            for p in range(max(chunk.start, first - 1),
                           min(chunk.start + chunk.num_tokens, req.num_prompt - 1)):
                rows.append(t + p - chunk.start)
                targets.append(req.token_ids[p + 1])
                owners.append((req, p + 1))
        t += chunk.num_tokens
    return rows, targets, owners


def _row_updates(chunks) -> tuple[list[int], list[int], list[int]]:
    """(rows, cols, slots) bringing each decode chunk's row up to all but its new slot."""
    rows, cols, slots = [], [], []
    for c in chunks:
        kv = c.req.kv
        rows += [kv.row] * (c.start - c.row_from)
        cols += range(c.row_from, c.start)
        slots += kv.slots[c.row_from:c.start]
    return rows, cols, slots
