"""Triton attention backend: split-KV (flash-decoding) decode and a ragged flash-attention
extend kernel over the page-size-1 KV pool. Same interface and results as
`TorchAttentionBackend`.

Imports triton at its top: the runner imports this module only when it is selected.
"""
from __future__ import annotations

import os

import torch
import triton

from engine.attention.base import ForwardBatch
from engine.attention.flashinfer_prefill import FlashInferPrefill, worth_it
from engine.kernels.attention.common import store_kv_kernel
from engine.kernels.attention.configs import PREFIX_MAX_SPLITS, TritonLaunchConfigs, smem_limit_of
from engine.kernels.attention.decode import (decode_partial_kernel, decode_reduce_kernel,
                                            prefix_attn_kernel)
from engine.kernels.attention.extend import extend_kernel
from engine.attention.kv_pool import KVPool
from engine.kernels.launch import pdl_launch

_LOG2E = 1.4426950408889634


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pow2_at_least(x: int, lo: int) -> int:
    return max(lo, triton.next_power_of_2(int(x)))


class _Partials:
    """Grow-only float32 scratch for partial attention outputs [..., block_d] and their
    log-sum-exps. Outgrown buffers go to `retired`, never freed: a captured CUDA graph may
    still read them."""

    def __init__(self, block_d: int, device: torch.device, retired: list[torch.Tensor]) -> None:
        self.block_d, self.device, self.retired = block_d, device, retired
        self.o: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None

    def get(self, bsz: int, hq: int, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        need = bsz * hq * splits
        if self.lse is None or self.lse.numel() < need:
            if self.lse is not None:
                self.retired += [self.o, self.lse]
            cap = max(need, 2 * (self.lse.numel() if self.lse is not None else 0))
            self.o = torch.empty(cap * self.block_d, dtype=torch.float32, device=self.device)
            self.lse = torch.empty(cap, dtype=torch.float32, device=self.device)
        o = self.o[:need * self.block_d].view(bsz, hq, splits, self.block_d)
        return o, self.lse[:need].view(bsz, hq, splits)


class TritonAttentionBackend(TritonLaunchConfigs):
    """Attention over the KV pool with Triton kernels.

    Args:
        kv_pool: the pool; K/V of layer l live in kv_pool.k[l] / kv_pool.v[l].
        scale: softmax scale (usually head_dim ** -0.5).
        max_kv_splits: upper bound on the decode split count (partials per request/head).
        graph_mode: when True the decode split count depends on the batch size only (it
            assumes the longest context, req_to_token.shape[1]), so a CUDA graph captured
            for one padded batch size is equally fast for any sequence lengths. Results are
            correct in either mode: a captured graph keeps the split count of its capture,
            and the kernels derive each request's chunking from seq_lens on the device.
        num_sms: multiprocessor count used by the split heuristic (read from the device
            when None).
        decode_split_min_tokens: a decode split is not made shorter than this many tokens
            (eager mode only; bounds the number of splits for short sequences).
        force_num_splits: fix the decode split count (tests, benchmarks); None = heuristic.
    """

    def __init__(self, kv_pool: KVPool, scale: float, *, max_kv_splits: int = 32,
                 graph_mode: bool = False, num_sms: int | None = None,
                 decode_split_min_tokens: int = 128,
                 force_num_splits: int | None = None, decode_stores_kv: bool = True) -> None:
        self.kv_pool = kv_pool
        self.scale = float(scale)
        self.max_kv_splits = max(1, int(max_kv_splits))
        self.graph_mode = graph_mode
        self.decode_split_min_tokens = decode_split_min_tokens
        self.force_num_splits = force_num_splits
        # False (`kernels.decode_stores_kv`): a pure decode step stores its new K/V with the
        # store kernel, a launch of its own per layer, instead of in the decode kernel.
        self.decode_stores_kv = decode_stores_kv
        device = kv_pool.k[0].device
        self.device = device
        if num_sms is None:
            if device.type == "cuda":
                num_sms = torch.cuda.get_device_properties(device).multi_processor_count
            else:
                num_sms = 132
        self.num_sms = num_sms
        self.kv_heads = kv_pool.k[0].shape[1]
        self.head_dim = kv_pool.k[0].shape[2]
        self.block_d = _pow2_at_least(self.head_dim, 16)
        self.cache_dtype = kv_pool.k[0].dtype
        # An fp8 pool (kv_cache_dtype="fp8_e4m3"): the kernels' KV_FP8 path, switched on by
        # these extra launch arguments; a bf16/fp16/fp32 pool launches without them (the
        # kernels' defaults), exactly as before fp8 existed. The stores (which also round the
        # step's new K/V in place for extend) get FP8_SW_ROUND: see triton_common.py.
        self.kv_fp8 = kv_pool.fp8
        self._kv_kw = dict(KV_FP8=True, KV_SCALE=float(kv_pool.scale)) if self.kv_fp8 else {}
        self._store_kw = dict(self._kv_kw, FP8_SW_ROUND=_interpreting()) if self.kv_fp8 else {}
        # The dtype of the dots and of the launch configs' tiles: the pool's, or with an fp8
        # pool the model's, learnt from the first forward's q (bf16, the usual case, until
        # then): fp8 K/V are dequantized to float16 for the dots over the pool (see
        # triton_common.py), the model's dtype still decides fp32 dots and extend tiles.
        self.dot_dtype = torch.bfloat16 if self.kv_fp8 else self.cache_dtype
        # fp32 models use IEEE fp32 dots; the CPU interpreter's bf16/fp16 dot is broken,
        # so it upcasts too.
        self.f32_dot = self.dot_dtype == torch.float32 or _interpreting()
        self._pdl = pdl_launch(device)  # every launch below: see engine/kernels/launch.py
        self.smem_limit = smem_limit_of(device)
        # Kernel launch configs: None = heuristics below; a dict overrides them (the
        # benchmark script sweeps these).
        self.decode_cfg: dict | None = None
        self.extend_cfg: dict | None = None
        # Per-step state set by prepare().
        self._prepared: ForwardBatch | None = None
        self._num_splits = 1
        self._mixed_splits = 1  # decode splits of a mixed step's leading decoders
        self._max_extend = 0
        # Decode partials: flat fp32 buffers, grown geometrically and never freed while
        # the backend lives (a captured CUDA graph may still point at an older one).
        self._retired: list[torch.Tensor] = []
        self._mid = _Partials(self.block_d, self.device, self._retired)  # split-KV decode
        # Radix-grouped decode (engine/core/prefix_groups.py): the prefix kernel's partials.
        self.prefix_cfg: dict | None = None
        self._grouped = None  # the step's PrefixGroupBatch when it runs grouped
        self._pfx = _Partials(self.block_d, self.device, self._retired)
        self.windows: dict[int, int] = {}
        # Large extend steps' attention by FlashInfer's Hopper kernel (flashinfer_prefill.py),
        # when the runner hands one over; `_fi_step`: this step's extend requests go there.
        self.flashinfer: FlashInferPrefill | None = None
        self._fi_step = False

    # The runner builds per-step group metadata only for backends that run it.
    supports_prefix_groups = True
    supports_sliding_window = True

    def set_sliding_windows(self, windows: dict[int, int]) -> None:
        """layer id -> window (the kernels' WINDOW): those layers attend to their last
        `window` tokens only. Their decode ignores prefix groups (a group's shared prefix
        may lie outside the window); the other layers still use them."""
        self.windows = dict(windows)

    def use_flashinfer_prefill(self, prefill: FlashInferPrefill) -> None:
        """From now on large extend steps' requests attend through `prefill` (its kernel is
        built here, before serving)."""
        prefill.warm_up(self.kv_pool.k[0], self.kv_pool.v[0])
        self.flashinfer = prefill

    # ------------------------------------------------------------------ per step
    def prepare(self, batch: ForwardBatch) -> None:
        self._prepared = batch
        self._grouped = None
        self._fi_step = False
        if batch.is_decode:
            bound = batch.req_to_token.shape[1] if self.graph_mode else batch.max_seq_len
            pg = getattr(batch, "prefix_groups", None)
            if pg is not None:
                self._grouped = pg
                if not self.graph_mode:
                    bound = pg.max_suffix  # the suffixes are what the decode kernel reads
            self._num_splits = self.choose_num_splits(batch.batch_size, bound)
        else:
            # A mixed step's leading decoders go to the decode kernel: through the extend
            # kernel each would be a 64-row query tile holding one row, per query head, which
            # made a W1 mixed step's attention several times its K/V bytes.
            d = batch.decode_rows
            if batch.decoders_on_device:  # sized for any lengths (the graph's capacity)
                self._mixed_splits = self.choose_num_splits(batch.batch_size,
                                                            batch.req_to_token.shape[1])
            else:
                self._mixed_splits = self.choose_num_splits(
                    d, max(batch.seq_lens_cpu[:d]), eager=True) if d else 1
            rest = batch.extend_lens_cpu[d:]
            self._max_extend = max(rest) if rest else 0
            self._fi_step = (self.flashinfer is not None and not batch.decoders_on_device
                             and worth_it(rest) and not torch.cuda.is_current_stream_capturing())
            if self._fi_step:
                self.flashinfer.plan(batch, d)

    def _mid_buffers(self, bsz: int, hq: int, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._mid.get(bsz, hq, splits)

    def _pfx_buffers(self, bsz: int, hq: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._pfx.get(bsz, hq, PREFIX_MAX_SPLITS)

    # ------------------------------------------------------------------ forward
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (any strides with a unit last stride); returns
        [T, Hq, D] (written into `out` when given, e.g. a preallocated buffer)."""
        if self._prepared is not batch:
            self.prepare(batch)
        if self.kv_fp8 and q.dtype != self.dot_dtype:  # the model's dtype, now known
            self.dot_dtype = q.dtype
            self.f32_dot = q.dtype == torch.float32 or _interpreting()
        k_cache, v_cache = self.kv_pool.k[layer_id], self.kv_pool.v[layer_id]
        if q.stride(-1) != 1:
            q = q.contiguous()
        if k.stride(-1) != 1:
            k = k.contiguous()
        if v.stride(-1) != 1:
            v = v.contiguous()
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        window = self.windows.get(layer_id, 0)
        if batch.is_decode:
            # the decode kernel stores request i's new K/V (row i of k, v) itself, at
            # req_to_token[row, seq_len - 1]: out_slots[i], written there before the step
            new_kv = (k, v) if self.decode_stores_kv else None
            if new_kv is None:
                self.store_kv(k, v, k_cache, v_cache, batch.out_slots)
            pg = self._grouped if not window else None
            self.decode(q, k_cache, v_cache, out, batch.req_rows, batch.seq_lens,
                        batch.req_to_token, self._num_splits, pg, window, new_kv=new_kv)
            return out
        self.store_kv(k, v, k_cache, v_cache, batch.out_slots)
        # A mixed step's decoders take the decode kernel (their new K/V are in the pool
        # already: store_kv ran above): the leading `decode_rows`, or in an extend graph
        # every one-token request, found on the device.
        if batch.decoders_on_device:
            self.decode(q, k_cache, v_cache, out, batch.req_rows, batch.seq_lens,
                        batch.req_to_token, self._mixed_splits, None, window, mixed=True,
                        rows_by=(batch.qo_indptr, batch.extend_lens))
            self.extend(q, k, v, k_cache, v_cache, out, batch, 0, window, skip_decoders=True)
            return out
        d = batch.decode_rows
        if d:
            self.decode(q[:d], k_cache, v_cache, out[:d], batch.req_rows[:d],
                        batch.seq_lens[:d], batch.req_to_token, self._mixed_splits, None, window,
                        mixed=True)
        if self._fi_step and not window:  # (a sliding-window layer: Triton; the plan has none)
            self.flashinfer.run(q, k_cache, v_cache, out)
        elif d < batch.batch_size:
            self.extend(q, k, v, k_cache, v_cache, out, batch, d, window)
        return out

    def store_kv(self, k, v, k_cache, v_cache, slots) -> None:
        t, hkv, d = k.shape
        if t == 0:
            return
        store_kv_kernel[(t,)](
            k, v, k_cache, v_cache, slots,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            HKV=hkv, HEAD_DIM=d, BLOCK_H=_pow2_at_least(hkv, 2), BLOCK_D=self.block_d,
            **self._store_kw, **self._pdl, num_warps=4 if hkv * d >= 1024 else 1)

    def decode(self, q, k_cache, v_cache, out, req_rows, seq_lens, req_to_token, splits: int,
               pg, window: int = 0, mixed: bool = False, rows_by=None,
               new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """One new token per request: q [B, Hq, D], request i's row `req_rows[i]` of
        `req_to_token` holds its `seq_lens[i]` slots (its new token's last). `pg`: the step's
        prefix groups (radix-grouped decode), or None. `mixed`: a mixed step's decoders.
        `rows_by` = (qo_indptr, extend_lens): request i's query is row qo_indptr[i] of q
        and out, and only requests with extend_lens[i] == 1 are attended. `new_kv`: the new
        tokens' (k, v) [B, Hkv, D], which the kernel then stores in the pool itself (else
        they are there already); not with `rows_by`."""
        bsz = req_rows.shape[0]
        hq, d = q.shape[1], q.shape[2]
        hkv = k_cache.shape[1]
        group = hq // hkv
        cfg = self.pick_decode_cfg(hkv * bsz * splits, mixed)
        block_h = _pow2_at_least(group, 16)
        sm_scale_log2 = self.scale * _LOG2E
        direct = splits == 1
        if direct:
            mid_o = mid_lse = out  # unused
            smb = smh = sms = slb = slh = 0
        else:
            mid_o, mid_lse = self._mid_buffers(bsz, hq, splits)
            smb, smh, sms = mid_o.stride(0), mid_o.stride(1), mid_o.stride(2)
            slb, slh = mid_lse.stride(0), mid_lse.stride(1)
        if pg is not None:
            # 1) each group's shared prefix, once per tile, into per-member partials;
            # 2) below, each request's own suffix, merged with them (log-sum-exp)
            pfx_o, pfx_lse = self._pfx_buffers(bsz, hq)
            pcfg = self.prefix_attention(q, k_cache, v_cache, req_to_token, pg, pfx_o, pfx_lse)
            pfx_args = (pg.pfx_len, pfx_o, pfx_lse, pg.ctrl)
            pstrides = (pfx_o.stride(0), pfx_o.stride(1), pfx_o.stride(2),
                        pfx_lse.stride(0), pfx_lse.stride(1))
            pkw = dict(HAS_PREFIX=True, PFX_BLOCK_N=pcfg["BLOCK_N"], PMAX=PREFIX_MAX_SPLITS)
        else:
            pfx_args = (seq_lens, out, out, seq_lens)  # unused
            pstrides = (0, 0, 0, 0, 0)
            pkw = {}
        if window:
            pkw = dict(WINDOW=window)
        qo_indptr, extend_lens = rows_by if rows_by is not None else (seq_lens, seq_lens)
        by_qo = int(rows_by is not None)
        if new_kv is None:
            k_new = v_new = q  # unused
            kv_kw = self._kv_kw
        else:
            k_new, v_new = new_kv
            kv_kw = dict(self._store_kw, STORE_KV=True)
        decode_partial_kernel[(hkv, bsz, splits)](
            q, k_new, v_new, k_cache, v_cache, req_to_token, req_rows, seq_lens, out,
            mid_o, mid_lse, *pfx_args, qo_indptr, extend_lens, sm_scale_log2, splits, by_qo,
            q.stride(0), q.stride(1),
            k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            req_to_token.stride(0),
            out.stride(0), out.stride(1),
            smb, smh, sms, slb, slh, *pstrides,
            GROUP=group, BLOCK_H=block_h, BLOCK_N=cfg["BLOCK_N"], HEAD_DIM=d,
            BLOCK_D=self.block_d, DIRECT=direct, F32_DOT=self.f32_dot, **pkw, **kv_kw,
            **self._pdl, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        if not direct:
            decode_reduce_kernel[(hq, bsz)](
                mid_o, mid_lse, seq_lens, out, splits,
                smb, smh, sms, slb, slh,
                out.stride(0), out.stride(1),
                *pfx_args, qo_indptr, extend_lens, by_qo, *pstrides,
                BLOCK_N=cfg["BLOCK_N"], HEAD_DIM=d, BLOCK_D=self.block_d,
                BLOCK_S=triton.next_power_of_2(splits), **pkw, **self._pdl,
                num_warps=1 if self.block_d <= 64 else 2)

    def prefix_attention(self, q, k_cache, v_cache, req_to_token, pg, pfx_o, pfx_lse) -> dict:
        """Launch the shared-prefix kernel (persistent grid): in graph mode the grid is
        sized by capacity (the live tile and split counts are read on the device)."""
        hq, d = q.shape[1], q.shape[2]
        hkv = k_cache.shape[1]
        group = hq // hkv
        cfg = self.pick_prefix_cfg(group)
        if self.graph_mode:
            items = pg.cap * hkv * PREFIX_MAX_SPLITS
        else:
            items = pg.num_tiles * hkv * pg.num_splits
        nprog = max(1, min(items, self.prefix_programs()))
        prefix_attn_kernel[(nprog,)](
            q, k_cache, v_cache, req_to_token, pg.ctrl, pg.tile_row, pg.tile_len,
            pg.tile_mstart, pg.tile_mcount, pg.members, pfx_o, pfx_lse,
            self.scale * _LOG2E,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            req_to_token.stride(0),
            pfx_o.stride(0), pfx_o.stride(1), pfx_o.stride(2),
            pfx_lse.stride(0), pfx_lse.stride(1),
            HKV=hkv, GROUP=group, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], HEAD_DIM=d,
            BLOCK_D=self.block_d, F32_DOT=self.f32_dot, **self._kv_kw, **self._pdl,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        return cfg

    def extend(self, q, k, v, k_cache, v_cache, out, batch: ForwardBatch, first: int = 0,
               window: int = 0, skip_decoders: bool = False) -> None:
        """The batch's requests from `first` on (their q/k/v rows are found through
        qo_indptr, so q, k, v and out stay whole); `skip_decoders`: not those with one new
        token (the decode kernel's)."""
        t, hq, d = q.shape
        hkv = k.shape[1]
        bsz = batch.batch_size - first
        if t == 0 or bsz <= 0:
            return
        cfg = self.pick_extend_cfg(hq, bsz, self._max_extend)
        num_m_blocks = triton.cdiv(max(1, self._max_extend), cfg["BLOCK_M"])
        extend_kernel[(hq, bsz, num_m_blocks)](
            q, k, v, k_cache, v_cache, out, batch.req_to_token, batch.req_rows[first:],
            batch.seq_lens[first:], batch.extend_lens[first:], batch.qo_indptr[first:],
            self.scale * _LOG2E, num_m_blocks, int(skip_decoders),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            batch.req_to_token.stride(0), out.stride(0), out.stride(1),
            GROUP=hq // hkv, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], HEAD_DIM=d,
            BLOCK_D=self.block_d, F32_DOT=self.f32_dot, **self._kv_kw,
            **({"WINDOW": window} if window else {}), **self._pdl,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


__all__ = ["TritonAttentionBackend"]
