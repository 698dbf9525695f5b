"""The sampler's GPU time per call: greedy, temperature, top-p, top-k, min-p, at 1 to 512
rows of a 128k vocabulary, with the sort-free cut (engine/layers/sampling_cut.py) and with
the sort, each forced (the engine takes the cut on GPUs); one table.

    python3 scripts/bench_sampler.py
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import engine.sampler as sampler_module  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.sampler import Sampler  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

VOCAB = 128256
SETTINGS = {"greedy": dict(temperature=0.0), "temperature 1": dict(temperature=1.0),
            "top_p 0.95": dict(temperature=1.0, top_p=0.95), "top_k 50": dict(temperature=1.0, top_k=50),
            "min_p 0.05": dict(temperature=1.0, min_p=0.05)}


def time_ms(sampler: Sampler, logits: torch.Tensor, reqs: list[Request], reps: int = 20) -> float:
    for _ in range(3):
        sampler.sample_tokens(logits, reqs)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        sampler.sample_tokens(logits, reqs)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def warm_up_gpu(sampler: Sampler, seconds: float = 1.0) -> None:
    """Sample until the GPU has run for `seconds`: the first rows of the table otherwise pay
    for its clocks ramping up (session 15: a 1-row sort read 0.90 ms in one tree, 0.48 in
    the other, in the same call)."""
    logits = torch.randn(512, VOCAB, device="cuda")
    reqs = [Request(f"w{i}", [1], SamplingParams(max_tokens=4, temperature=1.0, top_p=0.9))
            for i in range(512)]
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sampler.sample_tokens(logits, reqs)
        torch.cuda.synchronize()


def main() -> None:
    sampler = Sampler(torch.device("cuda"))
    warm_up_gpu(sampler)
    print("| rows | sampling | sort ms | sort-free cut ms |\n|---|---|---|---|")
    for rows in (1, 8, 64, 256, 512):
        logits = torch.randn(rows, VOCAB, device="cuda") * 3
        for name, kw in SETTINGS.items():
            reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4, **kw)) for i in range(rows)]
            times = []
            for sort_free in (False, True):
                sampler_module.SORT_FREE_CUT = sort_free
                times.append(time_ms(sampler, logits, reqs))
            print(f"| {rows} | {name} | {times[0]:.3f} | {times[1]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
