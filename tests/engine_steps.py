"""Driving an engine step by step with prompts that arrive mid-run (so later prompts join
requests already decoding: mixed steps), and a guard that a step never waits for the GPU."""
from __future__ import annotations


def never_syncing(method):
    """`method` run under torch's sync debug mode, which raises on any call that makes the
    host wait for the GPU (a list index, a copy from pageable memory, `.item()`...): wrap the
    overlap scheduler's launch methods with it (monkeypatch)."""
    import torch

    def run(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return method(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return run


def run_with_arrivals(engine, prompts: list[list[int]], arrivals: list[int], params
                      ) -> list[tuple[list[int], list[float]]]:
    """Step `engine` until every request finishes, adding prompt i at step `arrivals[i]`;
    (output token ids, their logprobs) per request, in prompt order."""
    reqs, step = [], 0
    while len(reqs) < len(prompts) or engine.has_work:
        while len(reqs) < len(prompts) and arrivals[len(reqs)] <= step:
            reqs.append(engine.add_request(f"r{len(reqs)}", prompts[len(reqs)], params))
        engine.step()
        step += 1
    return [(list(r.output_ids), list(r.output_logprobs)) for r in reqs]
