"""Launch configurations of the Triton attention kernels: block sizes, warps and pipeline
stages from the step's shape and the GPU's shared memory, and the decode / shared-prefix
split counts. Measured choices are noted where they are made (H200).

`TritonLaunchConfigs` is a mixin of `TritonAttentionBackend` (triton_backend.py), which sets
the attributes these read: block_d, dot_dtype, kv_fp8, smem_limit, num_sms, kv_heads,
max_kv_splits, graph_mode, decode_split_min_tokens, force_num_splits, and the override dicts
decode_cfg / extend_cfg / prefix_cfg (None: the heuristics below).
"""
from __future__ import annotations

import torch
import triton

PREFIX_MAX_SPLITS = 4  # PMAX: prefix partials kept per (request, head)
PREFIX_SPLIT_MIN_TOKENS = 256


def smem_limit_of(device: torch.device) -> int:
    """Shared memory one block may opt into (the CPU interpreter: an H100's)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(getattr(props, "shared_memory_per_block_optin", 99 * 1024))
    return 227 * 1024


class TritonLaunchConfigs:
    def _fits(self, rows: int, stages: int, elt: int, extra: int = 0) -> bool:
        """K and V tiles of `rows` x BLOCK_D per pipeline stage fit in shared memory."""
        return stages * rows * self.block_d * elt * 2 + extra <= self.smem_limit - 8 * 1024

    def pick_decode_cfg(self, programs: int, mixed: bool = False) -> dict:
        """Decode launch config from the number of stage-1 programs. Measured on an H200
        (Llama-3-8B shapes; benchmarks/history.md): a grid many waves deep
        (>= 8 per SM) runs best with one warp per program, which needs no cross-warp
        reductions and no shared-memory round trip of the probabilities (480 x 800: a bf16
        pool 379 us with BLOCK_N 32 against 420 with four warps; an fp8 pool 245 us with
        BLOCK_N 64 against 355); one to eight waves with two warps (64 x 1,024: bf16 69 us,
        fp8 50 against 73); a grid under one wave keeps four warps and BLOCK_N 128 (latency:
        fewer iterations). `mixed`: for a mixed step's decoders, always the in-between
        config: a few us matter little beside the step's prefill, and one config keeps the
        variants few (capture compiles the decode kernel's K/V-storing variant at every
        split count, the warm-up's eager mixed steps the non-storing one)."""
        if self.decode_cfg is not None:
            return self.decode_cfg
        if self.dot_dtype == torch.float32 or self.block_d > 128:
            return dict(BLOCK_N=32, num_warps=4, num_stages=2)
        elt = 1 if self.kv_fp8 else self.dot_dtype.itemsize  # K/V tiles as loaded
        if not mixed and programs < self.num_sms:
            cands = [(128, 4, 3), (64, 4, 3), (64, 4, 2)]
        elif not mixed and programs >= 8 * self.num_sms:
            cands = [(64, 1, 2), (32, 1, 2)] if self.kv_fp8 else [(32, 1, 2)]
        else:
            cands = [(64, 2, 3), (64, 2, 2)] if self.kv_fp8 else [(64, 2, 2)]
        for n, warps, st in cands + [(32, 2, 2)]:
            if self._fits(n, st, elt):
                return dict(BLOCK_N=n, num_warps=warps, num_stages=st)
        return dict(BLOCK_N=32, num_warps=4, num_stages=1)

    def pick_extend_cfg(self, hq: int, bsz: int, max_extend: int) -> dict:
        """Extend launch config. Measured on an H200 (32q/8kv/128, bf16):
        BLOCK_M 64 x BLOCK_N 64, 4 warps for prefill-shaped grids (8 x 512: 93-98 us, 128-row
        tiles 106+ us); BLOCK_N 128 when the grid is under one wave (one request, 128 new on a
        2048 prefix: 41 us against 48)."""
        if self.extend_cfg is not None:
            return self.extend_cfg
        if self.dot_dtype == torch.float32 or self.block_d > 128:
            return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1)
        elt = self.dot_dtype.itemsize
        q_bytes = 64 * self.block_d * elt
        programs = hq * bsz * triton.cdiv(max(1, max_extend), 64)
        if programs < self.num_sms and self._fits(128, 2, elt, q_bytes):
            return dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2)
        for st in (3, 2, 1):
            if self._fits(64, st, elt, q_bytes):
                return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=st)
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1)

    def pick_prefix_cfg(self, group: int) -> dict:
        """Prefix-kernel config: BLOCK_M query rows (members x GROUP heads) per tile.
        64 x 64 tiles, 4 warps, 3 stages: the extend kernel's best shape on the H200, and two
        CTAs fit per SM; the persistent grid uses two programs per SM."""
        if self.prefix_cfg is not None:
            cfg = dict(self.prefix_cfg)
        elif self.dot_dtype == torch.float32 or self.block_d > 128:
            cfg = dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1)
        else:
            elt = self.dot_dtype.itemsize
            q_bytes = 64 * self.block_d * elt
            cfg = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1)
            for st in (3, 2):
                if self._fits(64, st, elt, q_bytes):
                    cfg["num_stages"] = st
                    break
        cfg["BLOCK_M"] = max(cfg["BLOCK_M"], triton.next_power_of_2(max(1, group)))
        return cfg

    def prefix_members_per_tile(self, group: int) -> int:
        """Requests one prefix tile serves (GROUP query heads each)."""
        return max(1, self.pick_prefix_cfg(group)["BLOCK_M"] // max(1, group))

    def prefix_programs(self) -> int:
        return 2 * self.num_sms

    def prefix_num_splits(self, num_tiles: int, max_prefix: int) -> int:
        """Prefix split count P (host side, written into the step's metadata): enough work
        items (tiles x KV heads x P) for the persistent grid, splits of at least
        PREFIX_SPLIT_MIN_TOKENS tokens, at most PREFIX_MAX_SPLITS."""
        items = max(1, num_tiles * self.kv_heads)
        p = max(1, self.prefix_programs() // items)
        p = min(p, triton.cdiv(max(1, max_prefix), PREFIX_SPLIT_MIN_TOKENS), PREFIX_MAX_SPLITS)
        return max(1, p)

    def choose_num_splits(self, batch_size: int, max_seq_len: int, eager: bool = False) -> int:
        """Decode split count from host-side sizes only (no device reads). `eager`: for a
        launch no graph captures (a mixed step's decoders), bounded by the lengths even in
        graph mode."""
        if self.force_num_splits is not None:
            return max(1, min(int(self.force_num_splits), self.max_kv_splits))
        base = max(1, batch_size * self.kv_heads)
        target = 2 * self.num_sms  # programs for about two waves
        splits = triton.cdiv(target, base)
        if eager or not self.graph_mode:
            splits = min(splits, triton.cdiv(max(1, max_seq_len), self.decode_split_min_tokens))
        return max(1, min(splits, self.max_kv_splits))
