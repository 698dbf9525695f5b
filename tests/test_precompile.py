"""Parallel Triton compilation at start-up (engine/kernels/precompile.py).

CPU: the deferral hook through Triton's own hook call (the installed Triton builds its
arguments), the stand-ins it leaves and removes, the hook's install and restore, and the
switches. GPU: engines started (graphs and warm-up) on an empty Triton cache with and without
the parallel compile give the same greedy tokens, and with it every specialization but the
in-place kernels' was compiled ahead (by preload, on the pool's threads).
"""
from __future__ import annotations

import inspect
import json
import threading
from types import SimpleNamespace

import pytest
import torch

from engine.kernels import precompile
from moe_models import moe_factory  # noqa: F401 (a fixture)


def _triton_hook_call(jit_function, hook, key: str, is_warmup: bool):
    """Call `hook` the way the installed Triton calls jit_cache_hook before a compile."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend")
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    target = GPUTarget("cuda", 90, 32)
    args = dict(hook=hook, key=key, signature={"x": "*fp32"}, target=target, device=0,
                constants={}, options=CUDABackend(target).parse_options({}), configs=[{}],
                is_warmup=is_warmup)
    wanted = inspect.signature(jit_function._call_hook).parameters
    return jit_function._call_hook(**{k: v for k, v in args.items() if k in wanted})


def test_hook_defers_launches_and_passes_preloads_and_in_place_kernels():
    from engine.kernels.attention.common import store_kv_kernel
    from engine.kernels.moe.router import _softmax_topk_kernel

    deferred = precompile.Deferred()
    kernel_cache: dict = {}
    store_kv_kernel.device_caches[0] = (kernel_cache, {}, None, None, None)  # as a launch has it
    try:
        assert _triton_hook_call(store_kv_kernel, deferred.hook, "k1", is_warmup=False) is True
        # the skipped key's later launches find a do-nothing stand-in in memory
        stand_in = kernel_cache["k1"]
        assert stand_in.launch_metadata(None) is None and stand_in.run(1, 1, 1) is None
        assert _triton_hook_call(store_kv_kernel, deferred.hook, "k1", is_warmup=False) is True
        assert _triton_hook_call(store_kv_kernel, deferred.hook, "k2", is_warmup=False) is True
        kernel_cache["k2"] = "a real binary"  # (compiled meanwhile: kept)
        deferred.remove_placeholders()
        assert kernel_cache == {"k2": "a real binary"}
    finally:
        store_kv_kernel.device_caches.pop(0, None)
    assert len(deferred.specs) == 2  # one per launch key
    fn, spec = deferred.specs[("engine.kernels.attention.common.store_kv_kernel", "k1")]
    assert fn is store_kv_kernel and json.loads(spec)["name"].endswith("store_kv_kernel")
    # a preload (what compile_deferred calls) compiles; so does a kernel whose outputs index
    # memory (MoE's expert ids)
    assert not _triton_hook_call(store_kv_kernel, deferred.hook, "k3", is_warmup=True)
    assert not _triton_hook_call(_softmax_topk_kernel, deferred.hook, "k4", is_warmup=False)
    assert len(deferred.specs) == 2


def test_deferred_compiles_installs_and_restores_the_hook():
    triton = pytest.importorskip("triton")
    runtime = triton.knobs.runtime
    before = runtime.jit_cache_hook
    sentinel = lambda **kw: False  # noqa: E731
    runtime.jit_cache_hook = sentinel
    try:
        with precompile.deferred_compiles() as deferred:
            assert runtime.jit_cache_hook == deferred.hook
        assert runtime.jit_cache_hook is sentinel
        with pytest.raises(RuntimeError):
            with precompile.deferred_compiles():
                raise RuntimeError("capture failed")
        assert runtime.jit_cache_hook is sentinel
        with precompile.deferred_compiles(active=False):
            assert runtime.jit_cache_hook is sentinel
    finally:
        runtime.jit_cache_hook = before


def test_switches():
    ran = []
    assert precompile.compile_ahead(lambda: ran.append(1), active=False) == {} and not ran
    assert precompile.compile_workers(3) <= 3 and precompile.compile_workers(0) == 1


# ------------------------------------------------------------------ GPU: whole engines
def _forget_compiled_kernels() -> None:
    """Drop the engine kernels' in-memory binaries, which a fresh process would not have."""
    from engine.runtime.warmup import engine_kernels

    for fn in engine_kernels():
        fn.device_caches.clear()


def _start(model: str, tmp_path, monkeypatch, parallel: bool, cache: str):
    """An LLM on an empty Triton cache (on disk and in memory), and every compile its start
    made: (kernel, by preload, thread name)."""
    import triton

    from engine import LLM

    _forget_compiled_kernels()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / cache))
    compiles: list[tuple[str, bool, str]] = []
    old = triton.knobs.runtime.jit_post_compile_hook

    def hook(**kw):
        compiles.append((precompile.kernel_name(kw["fn"].jit_function), kw["is_manual_warmup"],
                         threading.current_thread().name))

    triton.knobs.runtime.jit_post_compile_hook = hook
    try:
        llm = LLM(model=model, device="cuda", dtype="bfloat16", max_running_requests=16,
                  cuda_graph_max_bs=8, cuda_graph_max_extend_tokens=128, max_model_len=512,
                  parallel_compile=parallel, max_total_tokens=8192)
    finally:
        triton.knobs.runtime.jit_post_compile_hook = old
    return llm, compiles


def _greedy(llm, prompts):
    from engine import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_parallel_compile_on_an_empty_cache_matches_serial(tiny_model_factory, moe_factory,
                                                           tmp_path, monkeypatch, arch):
    import gc

    model = tiny_model_factory(arch) if arch == "llama" else moe_factory(arch)
    prompts = [[5, 9, 17, 33, 2], list(range(3, 40)), [7] * 90]
    serial, serial_compiles = _start(model, tmp_path, monkeypatch, False, "serial")
    want = _greedy(serial, prompts)
    del serial
    gc.collect()
    torch.cuda.empty_cache()
    llm, compiles = _start(model, tmp_path, monkeypatch, True, "parallel")
    assert _greedy(llm, prompts) == want
    ahead = [c for c in compiles if c[1]]
    # the capture's and the warm-up's kernels were compiled ahead by preload on the pool's
    # threads; what compiled on a launch is at most the in-place kernels (argmax, MoE routing)
    assert ahead and all(t.startswith("triton-compile") for _, _, t in ahead), compiles
    on_launch = {name for name, warm, _ in compiles if not warm}
    assert on_launch <= precompile._IN_PLACE, on_launch
    assert {n for n, _, _ in serial_compiles} == {n for n, _, _ in compiles}
    times = llm.engine.runner.capture_times
    assert times["compile_ahead"] > 0 and {"decode_graphs", "extend_graphs"} <= set(times)
    assert llm.engine.startup["compile_ahead"]["compile_ahead"] > 0  # the warm-up's kernels


def test_a_failed_compile_ahead_leaves_the_kernel_to_its_first_launch(monkeypatch, caplog):
    """compile_deferred never fails the start: a specialization it cannot build (another
    Triton's serialization, a kernel that does not compile) compiles at its launch instead,
    where a real error is raised as it would be without this module."""
    calls = []

    class Unbuildable:
        fn = SimpleNamespace(__module__="tests", __qualname__="unbuildable")
        src = "def unbuildable(): pass"

        def preload(self, spec):
            calls.append(spec)
            raise RuntimeError("cannot build")

    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    deferred = precompile.Deferred({("tests.unbuildable", "k"): (Unbuildable(), "{}")})
    with caplog.at_level("WARNING", logger="engine.kernels.precompile"):
        precompile.compile_deferred(deferred, torch.device("cuda", 0))
    assert calls == ["{}"] and "tests.unbuildable" in caplog.text


def test_capture_all_compiles_ahead_in_one_round_then_captures_decode_then_extend(monkeypatch):
    """engine/executor/graph_capture.capture_all: one deferred pass over every graph's work
    (so one compile round), then the decode graphs (largest first) and the extend graphs
    captured into the pool the decode capture made, with one warm-up run per graph after
    the pass and two without it; a decode and an extend graph of the same (bs, tokens) are
    two graphs."""
    from engine.executor import graph_capture, graph_runner

    events = []

    def ahead(work, active):
        if active:
            events.append("defer")
            work()
            events.append("compile")
            return {"deferred_pass": 0.1, "compile_ahead": 0.2}
        return {}

    def capture_graphs(keys, run, pool=None, prepare=None, warmups=2):
        events.append(("capture", keys, pool, warmups))
        return graph_capture.Captured({k: f"graph {k}" for k in keys}, {k: None for k in keys},
                                      pool or "pool", {"captures": 0.0})

    monkeypatch.setattr(graph_capture, "compile_ahead", ahead)
    monkeypatch.setattr(graph_runner, "capture_graphs", capture_graphs)
    monkeypatch.setattr(graph_runner, "run_each",
                        lambda keys, run, prepare: events.append(("run", keys)))
    monkeypatch.setattr(graph_runner, "compile_decode_inputs",
                        lambda padded, r2t, statics: events.append(("inputs", padded)))
    runner = graph_runner.GraphRunner(None, None, torch.zeros(9, 128, dtype=torch.int32), 16,
                                      extend=(40, 16))
    decode = [graph_runner.GraphKey(True, s, s) for s in (16, 8, 4, 2, 1)]
    extend = [graph_runner.GraphKey(False, bs, t) for bs, t in
              ((16, 32), (16, 16), (8, 32), (8, 16), (4, 32), (4, 16), (2, 32), (2, 16),
               (1, 32), (1, 16))]
    inputs = [("inputs", s) for s in (1, 2, 4, 8, 16)]
    times = graph_capture.capture_all(runner, precompile=True)
    assert events == ["defer", ("run", decode), *inputs, ("run", extend), "compile",
                      ("capture", decode, None, 1), *inputs, ("capture", extend, "pool", 1)]
    assert times["compile_ahead"] == 0.2 and set(times["extend_graphs"]) == {"captures"}
    assert set(times["decode_graphs"]) == {"captures", "graph_inputs"}
    assert set(runner.graphs) == set(decode + extend) and len(runner.graphs) == 15
    events.clear()
    graph_capture.capture_all(runner, precompile=False)
    assert events == [("capture", decode, "pool", 2), *inputs, ("capture", extend, "pool", 2)]
