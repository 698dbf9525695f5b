"""Tensor parallelism on CPU: real processes joined by gloo give tp=1's greedy outputs, with
chunked prefill, radix-cache hits and prompt logprobs; worker processes never outlive the
LLM that started them."""
from __future__ import annotations

import gc
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.loading.demo_model import ARCHS
from engine.runtime.engine import Engine
from engine.layers.parallel import TPContext
from engine.models import LlamaForCausalLM, load_hf_config

ROOT = Path(__file__).resolve().parents[1]
GREEDY = dict(temperature=0.0, ignore_eos=True)


def random_prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randint(3, 700) for _ in range(r.randint(lo, hi))] for _ in range(n)]


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by a re-parenting init, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


@pytest.mark.parametrize("arch,tp_size", [("llama", 2), ("qwen3", 2), ("qwen2", 4)])
def test_greedy_outputs_equal_tp1(tiny_model_factory, arch, tp_size):
    """qwen2 at tp=4: 2 KV heads on 4 ranks (replicated), tied embeddings, qkv bias."""
    path = tiny_model_factory(arch)
    prompts = random_prompts(4, 3, 30, seed=tp_size)
    params = SamplingParams(max_tokens=8, **GREEDY)
    ref = LLM(model=path, dtype="float32", max_total_tokens=1024).generate(prompts, params)
    llm = LLM(model=path, dtype="float32", max_total_tokens=1024, tp_size=tp_size)
    pids = llm._workers.pids
    assert len(pids) == tp_size - 1
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    del llm, outs  # garbage collection stops the workers too
    gc.collect()
    assert wait_gone(pids) == []


def test_chunked_prefill_radix_hits_and_prompt_logprobs_at_tp2(tiny_llama):
    prefix = random_prompts(1, 30, 30, seed=7)[0]
    prompts = [prefix + tail for tail in random_prompts(3, 4, 12, seed=8)]
    greedy = SamplingParams(max_tokens=6, **GREEDY)
    scored = SamplingParams(max_tokens=3, prompt_logprobs_start=1, logprobs=True, **GREEDY)

    def run(tp_size: int):
        llm = LLM(model=tiny_llama, dtype="float32", max_total_tokens=512, chunked_prefill_size=7,
                  tp_size=tp_size)
        try:
            first = llm.generate(prompts[:1], greedy)  # fills the radix cache with the prefix
            rest = llm.generate(prompts[1:], greedy)
            score = llm.generate(prompts[2], scored)[0]
            return first + rest, score, llm.stats(), llm._workers.pids if llm._workers else []
        finally:
            llm.close()

    ref, ref_score, _, _ = run(1)
    outs, score, stats, pids = run(2)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.cached_tokens for o in outs] == [o.cached_tokens for o in ref]
    assert all(o.cached_tokens >= len(prefix) for o in outs[1:])
    assert stats["cached_tokens"] > 0
    assert score.token_ids == ref_score.token_ids
    torch.testing.assert_close(torch.tensor(score.prompt_logprobs[1:]),
                               torch.tensor(ref_score.prompt_logprobs[1:]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(score.logprobs), torch.tensor(ref_score.logprobs),
                               atol=1e-4, rtol=1e-4)
    assert wait_gone(pids) == []  # close() ended them


def _prompt_logprobs(prompts, **kw) -> list[float]:
    llm = LLM(dtype="float32", max_total_tokens=512, **kw)
    try:
        params = SamplingParams(max_tokens=1, prompt_logprobs_start=0, **GREEDY)
        outs = llm.generate(prompts, params)
        return [x for o in outs for x in o.prompt_logprobs if x is not None]
    finally:
        llm.close()


def test_fp8_at_tp2(tiny_model_factory, tmp_path):
    """FP8 weights split across 2 ranks. A block-scaled checkpoint (weights and scales fixed
    by the file, no activation rounding) gives tp=1's greedy tokens. On-the-fly FP8 rounds
    each rank's slice of a row-parallel linear's input with its own per-token scale (as vLLM
    and SGLang do), so its logits are not tp=1's: they must stay as close to the unquantized
    model's (on a tiny model of moderate weights: 0.07-0.08 mean |logprob| difference at
    either size, on this box)."""
    from fp8_checkpoints import write_fp8_checkpoints

    path = tiny_model_factory("llama", init_std=0.1)
    prompts = random_prompts(3, 20, 40, seed=12)
    fp8_dir, _ = write_fp8_checkpoints(path, tmp_path, "fp8-block")
    greedy = SamplingParams(max_tokens=8, **GREEDY)
    want = LLM(model=fp8_dir, dtype="float32", max_total_tokens=512).generate(prompts, greedy)
    tp2 = LLM(model=fp8_dir, dtype="float32", max_total_tokens=512, tp_size=2)
    try:
        assert [o.token_ids for o in tp2.generate(prompts, greedy)] == [o.token_ids for o in want]
    finally:
        tp2.close()

    reference = _prompt_logprobs(prompts, model=path)
    error = {}
    for tp in (1, 2):
        got = _prompt_logprobs(prompts, model=path, quantization="fp8", tp_size=tp)
        error[tp] = sum(abs(a - b) for a, b in zip(got, reference, strict=True)) / len(reference)
    print("FP8 mean |logprob| difference from the unquantized model by tp size:", error)
    assert 0 < error[2] <= 1.5 * error[1] + 0.01, error


_DRIVER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from engine import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(model={model!r}, dtype="float32", max_total_tokens=256, tp_size=2)
        llm.generate([5, 6, 7], SamplingParams(max_tokens=2))
        print(" ".join(map(str, llm._workers.pids)), flush=True)
        if sys.argv[1] == "hang":
            time.sleep(600)
        # else: exit without close(); atexit stops the workers
""")


def test_workers_never_outlive_their_parent(tiny_llama, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER.format(root=str(ROOT), model=tiny_llama))
    drivers = {mode: subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE,
                                      text=True) for mode in ("exit", "hang")}
    pids = {mode: [int(p) for p in d.stdout.readline().split()] for mode, d in drivers.items()}
    assert all(pids.values()), pids
    drivers["hang"].send_signal(signal.SIGKILL)  # no atexit, no __del__: the workers notice
    for d in drivers.values():
        assert d.wait(timeout=60) in (0, -signal.SIGKILL)
    assert wait_gone(pids["exit"] + pids["hang"]) == []


@pytest.mark.parametrize("tp_size", [2, 4])
def test_demo_archs_shard_evenly(tiny_model_factory, tp_size):
    """Every demo architecture builds on every rank (heads, KV heads, MLP width divide)."""
    for arch in ARCHS:
        cfg = load_hf_config(tiny_model_factory(arch))
        for rank in range(tp_size):
            with torch.device("meta"):
                model = LlamaForCausalLM(cfg, None, TPContext(rank, tp_size))
            attn = model.model.layers[0].self_attn
            assert attn.num_heads * tp_size == cfg.num_attention_heads
            assert attn.num_kv_heads == max(1, cfg.num_key_value_heads // tp_size)


def test_tp_needs_started_ranks(tiny_llama):
    with pytest.raises(ValueError, match="tp_size=2 needs its ranks"):
        Engine(EngineConfig(model=tiny_llama, device="cpu", tp_size=2))
    with pytest.raises(ValueError, match="dist_timeout_s"):
        EngineConfig(dist_timeout_s=0)



def test_gloo_interface_is_the_route_to_rank0(monkeypatch):
    import socket

    from engine.executor.distributed import _pick_gloo_interface, interface_towards

    loopback = interface_towards("127.0.0.1")
    assert loopback in [name for _, name in socket.if_nameindex()]
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    _pick_gloo_interface("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == loopback
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "chosen-by-the-user")
    _pick_gloo_interface("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "chosen-by-the-user"
    assert interface_towards("::1") is None  # IPv6: left to gloo's own choice


def test_a_rank_that_dies_at_start_up_fails_fast(tiny_llama, tmp_path):
    """A script without a main guard: spawn re-imports it in the rank's process, which dies
    there. The LLM must fail at once with the hint, not after the rendezvous timeout."""
    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from engine import LLM
        LLM(model={tiny_llama!r}, dtype="float32", device="cpu", tp_size=2, dist_timeout_s=120)
    """))
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=110)
    assert done.returncode != 0
    assert "tensor-parallel rank 1 exited" in done.stderr and "__main__" in done.stderr
    assert time.monotonic() - start < 60
