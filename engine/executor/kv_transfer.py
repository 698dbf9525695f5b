"""The bytes of the host tier (engine/core/host_tier.py): a host KV pool shaped like the
device's, and the copies between the two.

On a GPU the host pool is pinned and every copy is queued on a transfer stream of its own
(engine/kernels/kv_copy.py): that stream first waits for the work already queued on the
compute stream (the KV it copies out is written there, the slots it copies into may still
be read there), and the compute stream then waits for the copy before its next kernel. The
host thread never waits, so a step is never blocked by a transfer. Times come from CUDA
events, read once they are done. On a CPU engine the host pool is a second CPU pool and a
copy is a plain indexed copy, timed by the clock.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention.kv_pool import KVPool
from engine.config import EngineConfig
from engine.core.host_tier import HostTier
from engine.core.prefix_rows import PrefixRows
from engine.kernels.kv_copy import copy_rows

logger = logging.getLogger(__name__)


@dataclass
class TransferStats:
    write_back_bytes: int = 0
    load_bytes: int = 0
    write_back_s: float = 0.0
    load_s: float = 0.0
    write_backs: int = 0
    loads: int = 0


class KVTransfer:
    """Copies between `device` (the engine's KV pool) and a host pool of `host_slots`."""

    def __init__(self, device: KVPool, host_slots: int) -> None:
        self.device_pool = device
        where = device.k[0].device
        self.cuda = where.type == "cuda"

        def host_tensor(like: torch.Tensor) -> torch.Tensor:
            # slot 0 unused, as on the device (not zeroed: a row is always written before it
            # is read, and touching every page of tens of GiB would only slow the start)
            return torch.empty((host_slots + 1, *like.shape[1:]), dtype=device.dtype,
                               pin_memory=self.cuda)

        self.host_pool = KVPool.over([host_tensor(t) for t in device.k],
                                     [host_tensor(t) for t in device.v])
        self.row_bytes = token_bytes(device)
        self.stream = torch.cuda.Stream(where) if self.cuda else None
        self.kernel_ok = self.cuda and self._kernel_reaches_host()
        self.stats = TransferStats()
        self._timing: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    # -- KVMover ------------------------------------------------------------------------

    def write_back(self, device_slots: Sequence[int], host_slots: Sequence[int]) -> None:
        self._copy(self.device_pool, self.host_pool, device_slots, host_slots, "write_back")

    def load(self, host_slots: Sequence[int], device_slots: Sequence[int]) -> None:
        self._copy(self.host_pool, self.device_pool, host_slots, device_slots, "load")

    def read(self, host_slots: Sequence[int]) -> PrefixRows:
        """The host rows of `host_slots` as new CPU tensors (waits for queued copies)."""
        self.synchronize()
        idx = torch.tensor(list(host_slots), dtype=torch.int64)
        return PrefixRows(torch.stack([t.index_select(0, idx) for t in self.host_pool.k]),
                          torch.stack([t.index_select(0, idx) for t in self.host_pool.v]))

    def write(self, host_slots: Sequence[int], rows: PrefixRows, start: int) -> None:
        """Host rows `host_slots` = `rows`' tokens from `start` on (ValueError, nothing
        written, when their shape or dtype is not this pool's)."""
        n, pool = len(host_slots), self.host_pool
        for t, layers in ((rows.k, pool.k), (rows.v, pool.v)):  # V is empty in a latent pool
            want = (len(layers), *layers[0].shape[1:])
            if not isinstance(t, torch.Tensor) or t.dtype != pool.dtype \
                    or (t.shape[0], *t.shape[2:]) != want or t.shape[1] < start + n:
                raise ValueError(f"prefix KV of shape {tuple(getattr(t, 'shape', ()))} "
                                 f"{getattr(t, 'dtype', type(t))} does not fit this pool "
                                 f"(layers, tokens, *row) = ({want[0]}, >= {start + n}, "
                                 f"{', '.join(map(str, want[1:]))}) {pool.dtype}")
        self.synchronize()  # (a queued write-back may still be writing other rows)
        idx = torch.tensor(list(host_slots), dtype=torch.int64)
        for layer, (k, v) in enumerate(zip(pool.k, pool.v)):
            k.index_copy_(0, idx, rows.k[layer, start:start + n])
            v.index_copy_(0, idx, rows.v[layer, start:start + n])

    # -- copies -------------------------------------------------------------------------

    def _copy(self, src: KVPool, dst: KVPool, src_slots: Sequence[int],
              dst_slots: Sequence[int], kind: str) -> None:
        nbytes = len(src_slots) * self.row_bytes
        if kind == "load":
            self.stats.load_bytes += nbytes
            self.stats.loads += 1
        else:
            self.stats.write_back_bytes += nbytes
            self.stats.write_backs += 1
        if not self.cuda:
            began = time.perf_counter()
            si, di = torch.tensor(src_slots), torch.tensor(dst_slots)
            for s, d in _row_pairs(src, dst):
                d.index_copy_(0, di, s.index_select(0, si))
            self._add_time(kind, time.perf_counter() - began)
            return
        self._copy_on_stream(src, dst, src_slots, dst_slots, kind)

    def _copy_on_stream(self, src: KVPool, dst: KVPool, src_slots: Sequence[int],
                        dst_slots: Sequence[int], kind: str) -> None:
        compute = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(compute)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            host_idx = torch.tensor([list(src_slots), list(dst_slots)], dtype=torch.int64).pin_memory()
            idx = host_idx.to(self.stream.device, non_blocking=True)
            start.record()
            for s, d in _row_pairs(src, dst):
                self._copy_rows(s, d, idx, host_idx)
            end.record()
        compute.wait_event(end)
        self._timing.append((kind, start, end))

    def _copy_rows(self, src: torch.Tensor, dst: torch.Tensor, idx: torch.Tensor,
                   host_idx: torch.Tensor) -> None:
        """Rows idx[0] of src to rows idx[1] of dst (`host_idx`: the same on the host)."""
        if self.kernel_ok:
            copy_rows(src, dst, idx[0], idx[1])
        elif dst.is_cuda:  # host rows gathered by the CPU, then one upload
            rows = src.index_select(0, host_idx[0]).pin_memory()
            dst.index_copy_(0, idx[1], rows.to(dst.device, non_blocking=True))
        else:  # device rows gathered on the GPU; the download waits for them
            dst.index_copy_(0, host_idx[1], src.index_select(0, idx[0]).cpu())

    def _kernel_reaches_host(self) -> bool:
        """Whether the copy kernel can address the pinned host pool (unified addressing):
        one row copied to row 0 of each side, which no slot uses."""
        zero = torch.zeros(1, dtype=torch.int64, device=self.device_pool.k[0].device)
        try:
            copy_rows(self.device_pool.k[0], self.host_pool.k[0], zero, zero)
            copy_rows(self.host_pool.k[0], self.device_pool.k[0], zero, zero)
            torch.cuda.synchronize()
            return True
        except Exception:  # noqa: BLE001 - any refusal means: copy through torch instead
            logger.warning("the KV copy kernel cannot reach pinned host memory here; the host "
                           "tier copies through torch (its downloads make the host wait)",
                           exc_info=True)
            return False

    def _add_time(self, kind: str, seconds: float) -> None:
        if kind == "load":
            self.stats.load_s += seconds
        else:
            self.stats.write_back_s += seconds

    def collect_times(self) -> None:
        """Fold in the times of the copies that are done (never waits)."""
        pending = []
        for kind, start, end in self._timing:
            if end.query():
                self._add_time(kind, start.elapsed_time(end) / 1000)
            else:
                pending.append((kind, start, end))
        self._timing = pending

    def synchronize(self) -> None:
        """Wait for every queued copy (before the host reads the host pool itself)."""
        if self.stream is not None:
            self.stream.synchronize()
        self.collect_times()


def make_host_tier(config: EngineConfig, device: KVPool) -> tuple[HostTier, KVTransfer] | None:
    """The host tier `host_kv_cache_gb` asks for (None when 0)."""
    if config.host_kv_cache_gb <= 0:
        return None
    per_token = token_bytes(device)
    slots = int(config.host_kv_cache_gb * 2**30 // per_token)
    if slots < 1:
        raise ValueError(f"host_kv_cache_gb={config.host_kv_cache_gb} holds no token's KV "
                         f"({per_token} bytes each)")
    logger.info("host KV tier: %d tokens (%.1f GiB%s), %s write-back", slots,
                slots * per_token / 2**30, ", pinned" if device.k[0].is_cuda else "",
                config.host_kv_write_back)
    transfer = KVTransfer(device, slots)
    return HostTier(slots, transfer, eager=config.host_kv_write_back == "eager"), transfer


def _row_pairs(src: KVPool, dst: KVPool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(source, destination) tensors of every layer's K and V that hold bytes (MLA's latent
    pool has 0-wide V)."""
    return [(s, d) for s, d in zip(src.k + src.v, dst.k + dst.v) if s[0].numel()]


def token_bytes(pool: KVPool) -> int:
    """One token's K and V over every layer."""
    return pool.token_bytes
