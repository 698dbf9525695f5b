"""Triton kernels compiled in parallel at start-up (a fresh replica's start).

With an empty Triton cache a replica compiles a few dozen kernel specializations while it
captures its CUDA graphs, one after another on one core: 16-20 s of a 29-40 s start on an
H200. The compiles do not depend on each other, only on the launch keys the capture's
forwards reach. So `capture_all` (engine/executor/graph_capture.py) first runs
every graph's forward once inside `deferred_compiles()`: a launch whose binary is not in
memory yet is recorded (the specialization as Triton serializes it) and skipped. Then
`compile_deferred` compiles every recorded specialization on a thread pool, and the real
capture finds each binary in memory. The warm-up (engine/runtime/warmup.py), which compiles the
eager paths' kernels, runs its requests the same way twice (at tp 1). Threads suffice:
Triton's compiler spends its time in C++ passes and in ptxas and gcc subprocesses, not holding
the GIL (8 decode-kernel variants for sm_90: 9.2 s serially, 4.8 s on two threads of a 2-core
box).

A skipped launch leaves its outputs unwritten, so the deferred pass computes garbage. Floats
are harmless (its results are thrown away); integers that address memory are not. A kernel
whose outputs index memory (MoE's expert ids and expert-sorted rows, the argmax that picks
the next tokens) is registered with `compile_in_place`: during the pass it compiles and runs
as usual. The decode graphs' input writer (engine/executor/graph_inputs.py) is not: skipped, it leaves
the static inputs and req_to_token entries as they were, which are valid indices (zeros at
allocation, earlier steps' values after).

Triton 3.6 API used: `knobs.runtime.jit_cache_hook` (called before every compile with the
launch key and `specialization_data`; returning True skips the compile and the launch),
`JITFunction.preload(specialization_data)` (compiles into the same in-memory cache a launch
reads) and `CompiledKernel._init_handles()` (loads the binary and builds its C launcher, the
part a first launch would otherwise do serially). `EngineConfig.parallel_compile=False`
turns it off.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

_IN_PLACE: set[str] = set()  # kernels (qualified names) that run during a deferred pass
# what this process compiled ahead, for start-up reports (scripts/bench_offline.py)
# (seconds: wall; compile and load: summed over the threads; slowest: one specialization)
totals = {"specializations": 0, "seconds": 0.0, "compile_s": 0.0, "load_s": 0.0, "slowest_s": 0.0}


def kernel_name(jit_function) -> str:
    return f"{jit_function.fn.__module__}.{jit_function.fn.__qualname__}"


def compile_in_place(*kernels) -> None:
    """Register Triton kernels whose outputs address memory: a deferred pass compiles and
    launches them instead of skipping them."""
    _IN_PLACE.update(kernel_name(k) for k in kernels)


class _Skipped:
    """Stands in a kernel's in-memory cache for a deferred specialization until the pass
    ends, so its later launches skip at a launch's cost: through the hook, every launch
    would serialize the specialization again (3 of a decode capture's 5 s on an H200)."""

    function = packed_metadata = None

    def launch_metadata(self, *args) -> None:
        return None

    def run(self, *args) -> None:
        return None


@dataclass
class Deferred:
    """Specializations a deferred pass skipped, by (kernel, launch key)."""

    specs: dict[tuple[str, str], tuple[object, str]] = field(default_factory=dict)
    placeholders: list[tuple[dict, str]] = field(default_factory=list)

    def hook(self, *, key, fn, compile, is_manual_warmup=False, **_) -> bool:
        """`jit_cache_hook`: True (skip) records the launch; preloads and in-place kernels
        compile as usual."""
        name = kernel_name(fn.jit_function)
        if is_manual_warmup or name in _IN_PLACE:
            return False
        self.specs.setdefault((name, str(key)), (fn.jit_function, compile["specialization_data"]))
        caches = fn.jit_function.device_caches.get(compile.get("device"))
        if caches is not None:  # (kernel_cache, ...): Triton 3.6's JITFunction.device_caches
            caches[0][key] = _Skipped()
            self.placeholders.append((caches[0], key))
        return True

    def remove_placeholders(self) -> None:
        for cache, key in self.placeholders:
            if isinstance(cache.get(key), _Skipped):
                del cache[key]
        self.placeholders.clear()


@contextmanager
def deferred_compiles(active: bool = True) -> Iterator[Deferred]:
    """Inside, Triton launches that would compile are recorded and skipped (see module doc).
    Inactive (or without Triton), a plain block that records nothing."""
    deferred = Deferred()
    try:
        from triton import knobs
    except ImportError:
        active = False
    if not active:
        yield deferred
        return
    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = deferred.hook
    try:
        yield deferred
    finally:
        knobs.runtime.jit_cache_hook = previous
        deferred.remove_placeholders()


def compile_ahead(work: Callable[[], object], active: bool = True) -> dict[str, float]:
    """Run `work` with compiles deferred, then compile what it reached in parallel; returns
    seconds {"deferred_pass", "compile_ahead"}. The caller then runs the real work: this run
    computed garbage wherever it skipped a launch."""
    if not active:
        return {}
    t0 = time.perf_counter()
    with deferred_compiles() as deferred:
        work()
        torch.cuda.synchronize()
    dry = time.perf_counter() - t0
    device = torch.device("cuda", torch.cuda.current_device())
    return {"deferred_pass": dry, "compile_ahead": compile_deferred(deferred, device)}


# Each compile holds its own MLIR/LLVM context (a few hundred MB of host memory at peak): more
# threads would raise a pod's start-up memory for little, since a round lasts as long as its
# slowest kernel (H200, 16 threads: 54 specializations in 6.6 s, the slowest alone 4.9 s).
MAX_COMPILE_THREADS = 16


def compile_workers(pending: int) -> int:
    """Threads for `pending` compiles: one per core this process may run on, at most
    MAX_COMPILE_THREADS."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        cores = os.cpu_count() or 1
    return max(1, min(pending, cores, MAX_COMPILE_THREADS))


def compile_deferred(deferred: Deferred, device: torch.device) -> float:
    """Compile (and load) every recorded specialization, in parallel; returns seconds."""
    if not deferred.specs:
        return 0.0
    t0 = time.perf_counter()
    # the largest sources first: they tend to compile longest, and the round lasts until the
    # last one finishes
    items = sorted(deferred.specs.values(), key=lambda item: -len(getattr(item[0], "src", "")))
    workers = compile_workers(len(items))

    def build(item) -> tuple[float, float]:
        """Compile and load one specialization. Any failure here only costs time: the
        kernel then compiles at its first launch, as without this module, and a real error
        (a kernel that does not compile, too much shared memory) is raised there."""
        jit_function, spec = item
        torch.cuda.set_device(device)
        t1 = time.perf_counter()
        try:
            kernel = jit_function.preload(spec)
        except Exception:  # noqa: BLE001
            logger.warning("compiling %s ahead failed; it compiles at its first launch",
                           kernel_name(jit_function), exc_info=True)
            return time.perf_counter() - t1, 0.0
        t2 = time.perf_counter()
        try:
            kernel._init_handles()  # the C launcher's gcc build and the module load
        except Exception:  # noqa: BLE001
            logger.debug("loading %s deferred to its first launch", kernel_name(jit_function),
                         exc_info=True)
        return t2 - t1, time.perf_counter() - t2

    with ThreadPoolExecutor(workers, thread_name_prefix="triton-compile") as pool:
        spans = list(pool.map(build, items))
    took = time.perf_counter() - t0
    totals["specializations"] += len(items)
    totals["seconds"] += took
    totals["compile_s"] += sum(c for c, _ in spans)
    totals["load_s"] += sum(ld for _, ld in spans)
    totals["slowest_s"] = max(totals["slowest_s"], max(c + ld for c, ld in spans))
    logger.info("compiled %d Triton kernel specializations on %d threads in %.2fs",
                len(items), workers, took)
    return took
