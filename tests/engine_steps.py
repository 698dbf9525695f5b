"""Driving an engine step by step with prompts that arrive mid-run (so later prompts join
requests already decoding: mixed steps)."""
from __future__ import annotations


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
