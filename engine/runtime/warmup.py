"""Engine start-up: per-phase timing, and the warm-up that compiles every Triton kernel
specialization serving can reach before the engine reports ready.

Why: Triton compiles a kernel the first time it is launched with a new launch key
(constexprs, num_warps/num_stages, and for plain int and pointer arguments whether the value
== 1, is divisible by 16 / 16-byte aligned). Without a warm-up a fresh replica compiles on its
first requests of each new shape, 1.7-2.3 s each on an H200 with an empty Triton cache, which
is exactly when autoscaling has added it under load. The kernels opt out of the
specializations that vary per step (see engine/kernels/attention/common.py), so what is left
is a handful of launch configurations chosen by host-side sizes; this module drives a few
real requests through the engine that reach each of them:

- short prompts, alone and with prompt logprobs (more logits rows than requests: the LM
  head's other shapes; extend CUDA graphs when on, else eager extends);
- a prompt longer than one chunk: an eager, many-program extend (the other extend kernel
  config, and MoE's large expert blocks), then its second chunk extends a cached prefix;
- a prompt that hits the radix cache (extend over a cached prefix), alone and eager;
- a mixed step: decoding requests plus a new prompt's prefill in one batch; and eager mixed
  steps whose decoders take the decode kernel at every launch it can make there;
- sampled (temperature, top-p, top-k) as well as greedy requests, and the sort-free top-k /
  top-p / min-p cut that large sampled batches take (launched directly: `compile_variants`);
- eager decode at every (split count, kernel config) the decode heuristics can pick for a
  batch no decode graph covers (batches above cuda_graph_max_bs, or graphs off), plain and
  with a shared cached prefix (radix-grouped decode).

Decode steps up to cuda_graph_max_bs and short extends are already compiled by the graph
capture. The warm-up runs through `Engine.add_request` / `step`, so at tp > 1 the other
ranks run the same steps; afterwards the radix cache is flushed and the counters reset.
"""
from __future__ import annotations

import itertools
import logging
import random
import sys

from engine.kernels import precompile
from engine.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

WARMUP_ID = "__warmup__"
_ids = itertools.count()


def engine_kernels():
    """Every Triton kernel (JITFunction) the engine's loaded modules define or import; none
    without Triton."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("engine.") and mod is not None:
            for fn in list(vars(mod).values()):
                if isinstance(fn, JITFunction):
                    yield fn


def compiled_kernels() -> dict[str, int]:
    """Binaries each launched Triton kernel of the engine holds in memory (per device),
    by kernel name. Triton 3.6: `JITFunction.device_caches[device]` is (kernel_cache,
    kernel_key_cache, target, backend, binder) and `kernel_cache` gains one entry per
    specialization compiled (or loaded from the on-disk cache) in this process. Empty under
    the interpreter (TRITON_INTERPRET=1), which compiles nothing."""
    out: dict[str, int] = {}
    for fn in engine_kernels():  # (a kernel imported elsewhere counts once: keyed by name)
        n = sum(len(caches[0]) for caches in fn.device_caches.values())
        if n:
            out[precompile.kernel_name(fn)] = n
    return out


def _needs_warmup(engine) -> bool:
    """Triton kernels run only on CUDA (the CPU path is torch)."""
    return engine.runner.device.type == "cuda" and engine.config.enable_warmup


def warm_up(engine, force: bool = False) -> dict:
    """Run the warm-up (on CUDA, unless `config.enable_warmup` is off; `force`: on any
    device, for tests) and leave the engine as it was: no requests, an empty radix cache,
    zeroed counters. Marks the "warmup" phase of `engine.runner.startup`, logs the
    per-phase start-up time, and returns what it did."""
    timer = getattr(engine.runner, "startup", None)
    report: dict = {"waves": 0, "requests": 0, "steps": 0}
    if force or _needs_warmup(engine):
        before = compiled_kernels()
        waves = warmup_waves(engine)
        # At tp > 1 the other ranks would still compile one by one inside the deferred pass
        # (they follow rank 0's steps, not its hook), and rank 0 waits for them at every
        # all-reduce: the pass would only add its own time. Their graph capture defers on
        # every rank (engine/executor/graph_capture.capture_all).
        defer = (engine.runner.device.type == "cuda" and engine.config.tp_size == 1
                 and engine.config.parallel_compile)
        ahead = precompile.compile_ahead(lambda: _run_waves(engine, waves), defer)
        if ahead:
            _reset(engine)
            report["compile_ahead"] = ahead
        report.update(_run_waves(engine, waves))
        after = compiled_kernels()
        report["kernels_compiled"] = sum(after.values()) - sum(before.values())
        _reset(engine)
    if timer is not None:
        report["warmup_s"] = timer.mark("warmup")
        report["phases"] = dict(timer.phases)
        report["total_s"] = timer.total
        logger.info("engine started in %s; warm-up: %d requests in %d steps compiled %d "
                    "Triton binaries beyond the graph capture's", timer.summary(),
                    report["requests"], report["steps"], report.get("kernels_compiled", 0))
    return report


def _run_waves(engine, waves: list[Wave]) -> dict:
    """The warm-up's requests, wave by wave, then the sampler's cut variants (launched
    directly). Also run once with compiles deferred (engine/kernels/precompile.py): the sampled
    tokens stay valid ids then, since the argmax kernels that pick them compile in place."""
    report = {"waves": 0, "requests": 0, "steps": 0}
    for wave in waves:
        report["steps"] += _run_wave(engine, wave)
        report["waves"] += 1
        report["requests"] += len(wave)
    if engine.runner.device.type == "cuda":
        from engine.kernels.sampling_cut import compile_variants

        compile_variants(engine.runner.vocab_size, engine.runner.device)
    return report


# A wave: requests added together (after `delay` engine steps), run until all finish.
Wave = list[tuple[int, list[int], SamplingParams]]


def warmup_waves(engine) -> list[Wave]:
    """The warm-up's requests (see the module docstring for what each one reaches)."""
    cfg, runner = engine.config, engine.runner
    rng = random.Random(1234)
    vocab = runner.vocab_size
    lo = min(100, vocab // 2)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(lo, vocab) for _ in range(n)]

    max_prompt = max(1, min(runner.max_context, runner.kv_pool.num_slots // 2) - 16)
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    sampled = SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, top_k=50, ignore_eos=True)

    chunk = cfg.chunked_prefill_size if cfg.chunked_prefill_size > 0 else 2048
    step_tokens = max(1, min(chunk, cfg.max_prefill_tokens))

    def prefill_steps(bs: int, plen: int) -> int:
        """Steps until `bs` prompts of `plen` tokens, sent together, are all decoding."""
        return -(-bs * plen // step_tokens) + 1

    def with_prompt_logprobs(n_tokens: int, start: int) -> SamplingParams:
        return SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True,
                              prompt_logprobs_start=start)

    waves: list[Wave] = []
    for n in (1, 37, 300):
        n = min(n, max_prompt)
        waves.append([(0, prompt(n), greedy(4))])
        waves.append([(0, prompt(n), with_prompt_logprobs(2, max(0, n - 2)))])
    # Prompts just past the largest extend graph and twice that: the first eager prefills
    # of a size class were 2.7x their warm TTFT on a fresh H200 replica without them
    # (513 tokens: 43.7 ms cold, 16.4 ms warm; no kernel compiled).
    extend_tokens = extend_graph_tokens(runner)
    if extend_tokens:
        for n in (extend_tokens + 1, 2 * extend_tokens - 24):
            waves.append([(0, prompt(min(n, max_prompt)), greedy(2))])
    waves.append([(0, prompt(min(37, max_prompt)), sampled)])

    # Longer than a chunk and than one wave of extend programs: the many-program extend
    # config, then a chunk extending the cached first chunk.
    backend = runner.attn_backend
    wave_tokens = 64 * (getattr(backend, "num_sms", 132) // runner.q_heads + 1)
    long_ids = prompt(min(max_prompt, max(chunk + 300, wave_tokens + 1)))
    waves.append([(0, long_ids, greedy(2))])
    waves.append([(0, prompt(len(long_ids)), with_prompt_logprobs(2, len(long_ids) - 2))])
    # Radix hits: half of the long prompt is cached now (before the reset at the end).
    half = long_ids[:max(1, len(long_ids) // 2)]
    waves.append([(0, half + prompt(37), greedy(2))])
    waves.append([(0, half + prompt(37), with_prompt_logprobs(2, len(half) + 35))])

    # Mixed steps: eight requests decoding when a long prompt arrives (an eager mixed batch)
    # and when a short one does (a graph-sized one), then a batch of 40 varied prompts.
    n_mix = max(1, min(8, cfg.max_running_requests - 2))
    mixed: Wave = [(0, prompt(min(37, max_prompt)), greedy(16)) for _ in range(n_mix)]
    mixed.append((3, prompt(min(600, max_prompt)), greedy(2)))
    mixed.append((4, prompt(min(20, max_prompt)), greedy(2)))
    waves.append(mixed)
    n_batch = max(1, min(40, cfg.max_running_requests))
    waves.append([(0, prompt(rng.randint(1, min(300, max_prompt))), greedy(8))
                  for _ in range(n_batch)])

    # Eager decode, plain and (when on) radix-grouped: then the batch shares a cached prefix
    # long enough for the grouper to use it (min_tokens, and (batch - 1) x prefix tokens
    # saved >= its min_saved_tokens) and each request's own suffix is as long as the plain
    # shape's sequence (the decode kernel sizes its splits by the suffixes).
    grouper = runner.prefix_grouper
    for grouped in (False, True) if grouper is not None else (False,):
        for bs, seq_len in eager_decode_shapes(engine, 2 if grouped else 1):
            plen = seq_len - 1  # the first decode step reads prompt + its first output token
            prefix: list[int] = []
            if grouped:
                saved = getattr(grouper, "min_saved_tokens", 0)
                prefix = prompt(max(grouper.min_tokens, (saved + 1) // (bs - 1) + 16))
            if (bs * (plen + 64) + len(prefix) > runner.kv_pool.num_slots // 2
                    or len(prefix) + plen + 8 > max_prompt):
                logger.info("warm-up: eager decode at batch %d x %d tokens skipped (room)",
                            bs, seq_len)
                continue
            if prefix:
                waves.append([(0, prefix, greedy(1))])  # caches the shared prefix
            # decode steps at the full batch once every prompt has been prefilled
            waves.append([(0, list(prefix) + prompt(plen), greedy(prefill_steps(bs, plen) + 3))
                          for _ in range(bs)])

    # Eager mixed steps: `bs` requests decoding when a prompt too long for an extend graph
    # arrives, so the step's decoders take the decode kernel at each launch it can make.
    arriving = min(max_prompt, extend_tokens + 1 if extend_tokens else 37)
    for bs, seq_len in eager_decode_shapes(engine, mixed=True):
        plen = seq_len - 1
        if bs * (plen + 64) + arriving > runner.kv_pool.num_slots // 2 or plen + 8 > max_prompt:
            logger.info("warm-up: mixed step at %d x %d tokens skipped (room)", bs, seq_len)
            continue
        decoding_at = prefill_steps(bs, plen)
        wave = [(0, prompt(plen), greedy(decoding_at + 4)) for _ in range(bs)]
        waves.append(wave + [(decoding_at + 1, prompt(arriving), greedy(1))])
    return waves


def extend_graph_tokens(runner) -> int:
    """The most new tokens an extend graph holds; 0 without extend graphs."""
    graphs = getattr(runner, "graphs", None)
    return graphs.max_extend_tokens if graphs is not None else 0


def eager_decode_shapes(engine, min_batch: int = 1, mixed: bool = False) -> list[tuple[int, int]]:
    """One (batch, sequence length) per distinct launch of the Triton decode kernels that a
    decode step outside the decode graphs can make, the cheapest in tokens. A launch is set
    by the split count (DIRECT when 1; the reduce kernel's BLOCK_S = its next power of two)
    and the config `pick_decode_cfg` takes from the program count. With graphs on, only
    batches above the largest graph run eagerly and their split count depends on the batch
    alone (graph_mode); with graphs off it also depends on the longest sequence (for
    radix-grouped decode, the longest suffix after the shared prefix: then `min_batch` 2,
    as a group needs two requests). `mixed`: the decoders of an eager mixed step instead
    (any batch; split counts bounded by the lengths, graphs or not)."""
    runner, cfg = engine.runner, engine.config
    backend = runner.attn_backend
    if not hasattr(backend, "choose_num_splits"):
        return []
    graphs = runner.graphs
    first = graphs.max_bs + 1 if graphs is not None and not mixed else 1
    by_length = mixed or not backend.graph_mode
    m = backend.decode_split_min_tokens
    best: dict[tuple, tuple[int, int]] = {}
    for bs in range(max(first, min_batch), cfg.max_running_requests + 1):
        cap = backend.choose_num_splits(bs, runner.max_context, eager=mixed)
        for s in (range(1, cap + 1) if by_length else [cap]):
            seq_len = max(2, m * (s - 1) + 1)
            if (seq_len + 8 > runner.max_context
                    or backend.choose_num_splits(bs, seq_len, eager=mixed) != s):
                continue
            conf = backend.pick_decode_cfg(backend.kv_heads * bs * s, mixed)
            key = (s == 1, tuple(sorted(conf.items())), 1 << (s - 1).bit_length() if s > 1 else 0)
            if key not in best or bs * seq_len < best[key][0] * best[key][1]:
                best[key] = (bs, seq_len)
    return sorted(best.values())


def _run_wave(engine, wave: Wave) -> int:
    """Add the wave's requests (each after its delay in steps), step until all finish."""
    pending = sorted(wave, key=lambda x: x[0])
    ids = []
    steps = 0
    while pending or engine.has_work:
        while pending and pending[0][0] <= steps:
            _, prompt_ids, params = pending.pop(0)
            rid = f"{WARMUP_ID}{next(_ids)}"
            engine.add_request(rid, prompt_ids, params)
            ids.append(rid)
        engine.step()
        steps += 1
    for rid in ids:
        engine.requests.pop(rid, None)
    return steps


def _reset(engine) -> None:
    """Forget the warm-up: cached KV, cache events, counters."""
    engine.cache.reset()
    if engine.cache.record_events:
        engine.cache.drain_events()
    engine.scheduler.stats = type(engine.scheduler.stats)()  # (the step count too)
    engine.processor.num_jump_forward_tokens = 0
    if engine.speculator is not None:
        engine.speculator.reset_stats()
    runner = engine.runner
    if runner.prefix_grouper is not None:
        runner.prefix_grouper.reset_stats()
    if getattr(runner, "graphs", None) is not None:
        runner.graphs.decode_replays = runner.graphs.extend_replays = 0
