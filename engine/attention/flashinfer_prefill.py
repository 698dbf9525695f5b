"""Large extend steps through FlashInfer's Hopper prefill kernel (its "fa3" backend).

Measured on the H200 (benchmarks/attention_notes.md), per layer, over our
page-size-1 pool read in place (every slot a page of one token), this module's path against
`extend_kernel`: 1.34-1.36x faster on long prompts' chunks (1 x 16,000 new tokens: 3.69 against
4.94 ms; 1 x 8,192 over an 8,192-token prefix: 3.17 against 4.31), 1.43x on 4 x 1,024 over
1,024, 1.09-1.29x on batches of fresh 256-1,024-token prompts (8 x 512: 76 against 91 us),
slower on many short extends over long contexts (64 x 64 over 1,216: 452 against 307 us).
Each step also pays a host-side plan (the work schedule, from the step's lengths: 0.5-2.6 ms,
which the overlap scheduler hides behind the step before). So the Triton backend hands it
only the extend requests of large steps with enough new tokens per request (`worth_it`);
decode steps, mixed steps' decoders, short extends and every CUDA-graph step stay on Triton.

FlashInfer is optional (`pip install flashinfer-python`) and compiles its kernel with nvcc at
first use on a machine (110 s on 16 cores; then loaded from its cache in ~/.cache/flashinfer,
or under $FLASHINFER_WORKSPACE_BASE). The engine builds or loads it at start-up (`start_loading`
on a thread while the weights load, then `warm_up`), never inside a served step, and "auto"
takes it only when it is built and current (`kernel_is_built`). docs/deploy.md says how
to bake it into an image.
"""
from __future__ import annotations

import importlib.util
import itertools
import subprocess
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.attention.base import ForwardBatch

# `worth_it`'s thresholds, from the measured cases above: every case from 32 x 256 up won;
# short extends over long contexts (64 x 64 over 1,216) lost.
MIN_NEW_TOKENS = 4096
MIN_MEAN_NEW_TOKENS = 256
WORKSPACE_BYTES = 128 << 20  # FlashInfer's split-KV scratch (its documented default)


def unavailable_reason(device: torch.device, kv_dtype: torch.dtype) -> str | None:
    """Why FlashInfer's fa3 prefill cannot serve this engine, or None when it can."""
    if device.type != "cuda":
        return f"it needs a CUDA GPU (the engine runs on {device.type})"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"its fa3 kernel needs a Hopper GPU (sm_90); this one is sm_{major}{minor}"
    if kv_dtype not in (torch.bfloat16, torch.float16):
        return (f"the KV cache is {str(kv_dtype).replace('torch.', '')}; it serves bfloat16 "
                "and float16 pools here (an fp8 pool stays on the Triton kernels)")
    if importlib.util.find_spec("flashinfer") is None:
        return "the flashinfer package is not installed (pip install flashinfer-python)"
    return None


def _fa3_spec(dtype: torch.dtype, head_dim: int):
    """FlashInfer's JIT spec of the fa3 paged prefill module that `plan` loads for this model
    (q, K/V and output in `dtype`, int32 indices, no positional encoding, window, soft cap or
    fp16 reduction)."""
    from flashinfer.jit import gen_batch_prefill_module

    return gen_batch_prefill_module("fa3", dtype, dtype, dtype, torch.int32, head_dim, head_dim,
                                    0, False, False, False)


def kernel_is_built(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether FlashInfer's fa3 prefill module for this dtype and head size is built and
    current (installed prebuilt, or in its JIT cache with nothing for ninja to redo): "auto"
    takes FlashInfer only then, so it never adds a 60-110 s compile to a replica's start.
    False when FlashInfer cannot say (an API of another version)."""
    try:
        spec = _fa3_spec(dtype, head_dim)
        return bool(spec.is_compiled) and _jit_build_is_current(spec)
    except Exception:  # noqa: BLE001 - an optional package's internals: unknown means not built
        return False


def _jit_build_is_current(spec) -> bool:
    """FlashInfer runs ninja before loading a JIT-cached module, so a cache holding the library
    without its objects and build log, or older than FlashInfer's installed sources, rebuilds
    at the first `plan` (seen on the H200: 68 s of a start). Ninja's dry run says whether it
    would."""
    if getattr(spec, "is_aot", False):
        return True
    spec.write_ninja()  # as FlashInfer's own build does first
    dry = subprocess.run(["ninja", "-n", "-C", str(spec.build_dir), "-f", str(spec.ninja_path)],
                         capture_output=True, text=True, check=False, timeout=60)
    return dry.returncode == 0 and "no work to do" in dry.stdout


def load_kernel(dtype: torch.dtype, head_dim: int, build: bool) -> float | None:
    """Import FlashInfer and load its fa3 prefill module (building it first when `build`, else
    returning None when it is not built): the seconds it took. Host work only (the package's
    import and FlashInfer's JIT spec: 4-12 s on the H200 machine), so the runner runs it on
    a thread while the weights load; `FlashInferPrefill.warm_up` then runs the kernel once."""
    start = time.perf_counter()
    if not build and not kernel_is_built(dtype, head_dim):
        return None
    import flashinfer  # noqa: F401 - the whole package, as `plan` will want it

    _fa3_spec(dtype, head_dim).build_and_load()
    return time.perf_counter() - start


def start_loading(dtype: torch.dtype, head_dim: int, build: bool) -> Future:
    """`load_kernel` on a background thread; the future re-raises its error."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashinfer-load")
    future = pool.submit(load_kernel, dtype, head_dim, build)
    pool.shutdown(wait=False)
    return future


def worth_it(extend_lens: list[int]) -> bool:
    """Whether a step's extend requests (their new-token counts) go to FlashInfer."""
    new = sum(extend_lens)
    return new >= MIN_NEW_TOKENS and new >= MIN_MEAN_NEW_TOKENS * len(extend_lens)


def key_slots(req_to_token: torch.Tensor, req_rows: torch.Tensor, seq_lens: torch.Tensor,
              total: int) -> torch.Tensor:
    """The pool slot of every key of the requests, request after request: key j of request
    i is req_to_token[req_rows[i], j] for j < seq_lens[i]; `total` = sum(seq_lens), known on
    the host, so nothing waits for the device."""
    lens = seq_lens.long()
    starts = torch.cumsum(lens, 0) - lens
    rows = torch.repeat_interleave(req_rows, lens, output_size=total)
    first = torch.repeat_interleave(starts, lens, output_size=total)
    return req_to_token[rows, torch.arange(total, device=lens.device) - first]


def host_indptr(lengths: list[int]) -> torch.Tensor:
    """[0, l0, l0 + l1, ...] as a host int32 tensor (FlashInfer plans on the host)."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _plan_args(extend_lens: list[int], seq_lens: list[int], slots: torch.Tensor,
               num_q_heads: int, kv_heads: int, head_dim: int, scale: float,
               dtype: torch.dtype) -> dict:
    """FlashInfer's plan arguments. Its host-side lengths are pinned: FlashInfer copies them
    to the device with non_blocking=True, and from pageable memory torch would make that
    copy wait for the stream, stalling the overlap scheduler's host (the step before has
    not finished when this one is planned). `seq_lens` given spares FlashInfer deriving them
    into a pageable tensor of its own."""
    return dict(qo_indptr=host_indptr(extend_lens).pin_memory(),
                paged_kv_indptr=host_indptr(seq_lens).pin_memory(), paged_kv_indices=slots,
                paged_kv_last_page_len=torch.ones(len(seq_lens), dtype=torch.int32).pin_memory(),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32).pin_memory(),
                num_qo_heads=num_q_heads, num_kv_heads=kv_heads, head_dim_qk=head_dim,
                page_size=1, causal=True, sm_scale=scale, q_data_type=dtype, kv_data_type=dtype)


class _Planner:
    """One FlashInfer wrapper and the event that says its last plan's copies are done.

    A plan writes the work schedule into the wrapper's pinned host buffer and copies it to
    the device asynchronously; re-planning the same wrapper before that copy has run (the
    overlap scheduler plans step N+1 while step N's work is queued) would overwrite it. Two
    planners alternate, and each waits for its own previous copy (in practice long done)."""

    def __init__(self, workspace: torch.Tensor) -> None:
        import flashinfer

        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD",
                                                                      backend="fa3")
        self.copied: torch.cuda.Event | None = None

    def plan(self, **kw) -> None:
        if self.copied is not None and not self.copied.query():
            self.copied.synchronize()
        self.wrapper.plan(**kw)
        self.copied = torch.cuda.Event()
        self.copied.record()


class FlashInferPrefill:
    """One model's attention shapes (per rank) and two planners. Per step: `plan` the extend
    requests from `first` on; per layer: `run`."""

    def __init__(self, device: torch.device, scale: float, num_q_heads: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype) -> None:
        self.shape_args = dict(num_q_heads=num_q_heads, kv_heads=kv_heads, head_dim=head_dim,
                               scale=float(scale), dtype=dtype)
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._planners = [_Planner(workspace), _Planner(workspace)]
        self._turn = 0
        self._wrapper = None  # the planned step's (plan sets it; run reads it)
        self._q_start = 0
        self.steps = 0  # steps planned here (tests and benchmarks read it)

    def plan(self, batch: ForwardBatch, first: int) -> None:
        """Requests first.. of the batch, their K/V (prefix and new) already in the pool."""
        ext, lens = batch.extend_lens_cpu[first:], batch.seq_lens_cpu[first:]
        self._q_start = sum(batch.extend_lens_cpu[:first])
        slots = key_slots(batch.req_to_token, batch.req_rows[first:], batch.seq_lens[first:],
                          sum(lens))
        planner = self._planners[self._turn]
        self._turn ^= 1
        planner.plan(**_plan_args(ext, lens, slots.int(), **self.shape_args))
        self._wrapper = planner.wrapper
        self.steps += 1

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            out: torch.Tensor) -> None:
        """Attention of the planned requests' new tokens (rows from the plan's first on of q
        [T, Hq, D]) into the same rows of out; k_cache/v_cache [slots, Hkv, D]: one layer."""
        s = self._q_start
        self._wrapper.run(q[s:], (k_cache.unsqueeze(1), v_cache.unsqueeze(1)),
                          out=out[s:])

    def warm_up(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Build (JIT-compile, or load from FlashInfer's cache) the kernel now: one request
        of 16 tokens over the pool's padding slot 0, which is never read as a real key."""
        n = 16
        planner = self._planners[0]
        slots = torch.zeros(n, dtype=torch.int32, device=k_cache.device)
        planner.plan(**_plan_args([n], [n], slots, **self.shape_args))
        shape = self.shape_args
        q = torch.zeros(n, shape["num_q_heads"], shape["head_dim"], dtype=shape["dtype"],
                        device=k_cache.device)
        planner.wrapper.run(q, (k_cache.unsqueeze(1), v_cache.unsqueeze(1)),
                            out=torch.empty_like(q))
        torch.cuda.synchronize(k_cache.device)


__all__ = ["FlashInferPrefill", "kernel_is_built", "key_slots", "load_kernel", "start_loading",
           "unavailable_reason", "worth_it"]
