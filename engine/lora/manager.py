"""LoRA adapters of one engine: the registry (name -> adapter, with a host copy for at most
`max_cpu_loras` of them, the rest re-read from disk when needed), the GPU pool of
`max_loras` slots with LRU eviction, and the scheduler's gate (`acquire` / `release`): a
running request holds its adapter's slot, so a step never batches more adapters than the
pool has slots, and a slot is only reused once no running request holds it.

Every registered adapter gets an id of its own (never reused): the radix cache keys a
request's prefixes by it, so a prefix computed under one adapter never serves another, nor
the same name loaded again with other weights.
"""
from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from engine.config import EngineConfig
from engine.core.request import Request
from engine.core.step_plan import StepPlan
from engine.lora.adapter import LoRAAdapter, LoRAError, LoRANotFoundError, load_adapter
from engine.lora.layer import LoRABatch, LoRAHook
from engine.lora.pool import LoRAPool, target_shapes

logger = logging.getLogger(__name__)


@dataclass
class LoRAStats:
    requests: int = 0  # requests admitted under an adapter
    slot_hits: int = 0  # of them, adapter already in a GPU slot
    slot_loads: int = 0  # adapters copied into a GPU slot
    disk_loads: int = 0  # adapters read from disk (registration, or after host eviction)
    dynamic_loads: int = 0  # adapters registered on first use from lora_dynamic_path

    def as_dict(self) -> dict[str, int]:
        return {f"lora_{k}": v for k, v in vars(self).items()}


@dataclass
class _Entry:
    id: int
    name: str
    path: str
    rank: int
    adapter: LoRAAdapter | None  # None: its host copy was evicted (re-read from `path`)
    slot: int = -1
    targets: list[str] = field(default_factory=list)


class LoRAManager:
    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.config = config
        self.shapes = target_shapes(model)
        self.pool = LoRAPool(model, config.max_loras, config.max_lora_rank, dtype, device)
        # the largest step a CUDA graph runs: a decode batch, or an extend's tokens
        graph_rows = max(config.max_running_requests, config.cuda_graph_max_bs,
                         config.cuda_graph_max_extend_tokens)
        self.batch = LoRABatch(graph_rows + 1, config.max_loras, device)
        self._attach(model)
        self.entries: dict[str, _Entry] = {}
        self._ids = itertools.count(1)
        self._host_lru: OrderedDict[str, None] = OrderedDict()
        self.slot_owner: list[_Entry | None] = [None] * config.max_loras
        self.slot_pins = [0] * config.max_loras
        self._slot_clock = itertools.count()
        self.slot_used = [0] * config.max_loras
        self.stats = LoRAStats()
        logger.info("LoRA pool: %d slots of rank %d (%.1f MiB)", config.max_loras,
                    self.pool.rank, self.pool.nbytes / 2**20)
        for name, path in (config.lora_modules or {}).items():
            self.load(name, path)

    def _attach(self, model: nn.Module) -> None:
        from engine.kernels.lora import column_tile

        for g in self.pool.groups:
            tile = column_tile(g.bounds + [sum(g.part_sizes)])
            if tile is None and self.batch.on_gpu:
                raise LoRAError(f"layer {g.layer}: output sizes {g.part_sizes} are not multiples "
                                "of 16, which the LoRA kernels need")
            g.linear.lora = LoRAHook(g, self.pool, self.batch, tile)
        model.lora_batch = self.batch

    # -- registry -----------------------------------------------------------------------

    def load(self, name: str, path: str) -> int:
        """Register the adapter at `path` as `name` (LoRAError when it cannot serve)."""
        if not name or not isinstance(name, str):
            raise LoRAError(f"an adapter needs a name, got {name!r}")
        if name in self.entries:
            raise LoRAError(f"an adapter named {name!r} is already loaded")
        adapter = self._read(name, path)
        entry = _Entry(next(self._ids), name, str(path), adapter.rank, adapter,
                       targets=sorted(adapter.target_modules))
        self.entries[name] = entry
        self._keep_on_host(entry)
        return entry.id

    def _read(self, name: str, path: str) -> LoRAAdapter:
        self.stats.disk_loads += 1
        return load_adapter(name, path, self.shapes, self.config.max_lora_rank)

    def _keep_on_host(self, entry: _Entry) -> None:
        self._host_lru[entry.name] = None
        self._host_lru.move_to_end(entry.name)
        limit = self.config.max_cpu_loras
        while limit is not None and len(self._host_lru) > limit:
            oldest, _ = self._host_lru.popitem(last=False)
            self.entries[oldest].adapter = None

    def id_of(self, name: str) -> int:
        entry = self.entries.get(name)
        if entry is None:
            raise LoRANotFoundError(f"no adapter named {name!r} is loaded")
        return entry.id

    def unload(self, name: str) -> None:
        """Forget `name`; the engine refuses first while requests use it (a slot still held
        here means one runs)."""
        entry = self.entries.get(name)
        if entry is None:
            raise LoRANotFoundError(f"no adapter named {name!r} is loaded")
        if entry.slot >= 0 and self.slot_pins[entry.slot]:
            raise LoRAError(f"adapter {name!r} is in use by running requests")
        del self.entries[name]
        self._host_lru.pop(name, None)
        if entry.slot >= 0:
            self.slot_owner[entry.slot] = None

    def check(self, name: str) -> None:
        """LoRANotFoundError unless `name` is registered (by name or path) or can load from
        `lora_dynamic_path`; reads only (any thread may ask)."""
        if self._find(name) is None and self._dynamic_path(name) is None:
            raise LoRANotFoundError(f"The model '{name}' does not exist")

    def resolve(self, name: str) -> int:
        """The id of adapter `name` (a registered name, or the path it was loaded from); one
        not registered is loaded from `lora_dynamic_path` when there."""
        entry = self._find(name)
        if entry is not None:
            return entry.id
        path = self._dynamic_path(name)
        if path is None:
            raise LoRANotFoundError(f"The model '{name}' does not exist")
        adapter_id = self.load(name, str(path))
        self.stats.dynamic_loads += 1
        return adapter_id

    def _find(self, name: str) -> _Entry | None:
        entry = self.entries.get(name)
        if entry is None:  # SGLang's lora_path may name the adapter's path
            entry = next((e for e in list(self.entries.values()) if e.path == name), None)
        return entry

    def _dynamic_path(self, name: str) -> Path | None:
        root = self.config.lora_dynamic_path
        if not root or "/" in name or "\\" in name or name.startswith("."):
            return None
        path = Path(root).expanduser() / name
        return path if path.is_dir() else None

    def list(self) -> list[dict]:
        return [{"name": e.name, "path": e.path, "id": e.id, "rank": e.rank,
                 "target_modules": e.targets, "in_gpu": e.slot >= 0}
                for e in self.entries.values()]

    def _entry_of(self, req: Request) -> _Entry:
        entry = next((e for e in self.entries.values() if e.id == req.lora_id), None)
        if entry is None:
            raise LoRANotFoundError(f"adapter {req.params.lora!r} was unloaded")
        return entry

    # -- the scheduler's gate -----------------------------------------------------------

    def acquire(self, req: Request) -> bool:
        if req.lora_id == 0 or req.lora_slot >= 0:
            return True
        entry = self._entry_of(req)
        if entry.slot < 0:
            slot = self._free_slot()
            if slot is None:
                return False
            self._fill(slot, entry)
        else:
            self.stats.slot_hits += 1
        self.stats.requests += 1
        self.slot_pins[entry.slot] += 1
        self.slot_used[entry.slot] = next(self._slot_clock)
        req.lora_slot = entry.slot
        return True

    def release(self, req: Request) -> None:
        if req.lora_slot >= 0:
            self.slot_pins[req.lora_slot] -= 1
            req.lora_slot = -1

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used one no running request holds."""
        free = [s for s, owner in enumerate(self.slot_owner) if owner is None]
        if free:
            return free[0]
        idle = [s for s in range(len(self.slot_owner)) if self.slot_pins[s] == 0]
        return min(idle, key=self.slot_used.__getitem__) if idle else None

    def _fill(self, slot: int, entry: _Entry) -> None:
        old = self.slot_owner[slot]
        if old is not None:
            old.slot = -1
        if entry.adapter is None:
            entry.adapter = self._read(entry.name, entry.path)
        self._keep_on_host(entry)
        self.pool.write(slot, entry.adapter)
        self.slot_owner[slot], entry.slot = entry, slot
        self.stats.slot_loads += 1

    # -- per step -------------------------------------------------------------------------

    def prepare(self, plan: StepPlan) -> None:
        """Stage the step's adapter slot per chunk before its forward."""
        self.batch.stage([c.req.lora_slot for c in plan.chunks],
                         [c.num_tokens for c in plan.chunks], plan.is_decode)

    def stats_dict(self) -> dict[str, int]:
        """Counters, and where the adapters are: `lora_in_gpu` (in a pool slot) and
        `lora_in_cpu` (a host copy, no slot), which the router ranks replicas by."""
        in_gpu = sorted(o.name for o in self.slot_owner if o is not None)
        in_cpu = sorted(e.name for e in self.entries.values()
                        if e.slot < 0 and e.adapter is not None)
        return dict(self.stats.as_dict(), lora_adapters=len(self.entries),
                    lora_slots_used=len(in_gpu), lora_in_gpu=in_gpu, lora_in_cpu=in_cpu)
