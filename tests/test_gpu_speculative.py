"""Speculative decoding and prompt logprobs on a GPU with CUDA graphs: verify steps (k + 1
logits rows per request) replay the extend graphs, the draft model replays its own graphs,
and every output equals plain decoding / the eager path. Runs with `pytest -m gpu`."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from test_speculative import GREEDY, copy_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

KW = dict(dtype="float32", device="cuda", max_total_tokens=8192, cuda_graph_max_bs=16)


def record_runs(graphs, decode: bool = False) -> list[tuple[int, int]]:
    """(logits rows, requests) of each step one kind of the runner's graphs runs, as they
    happen: extend replays (`run_extend`), or decode replays: `run_decode` and `run_packed`
    (a packed decode step, engine/executor/graph_inputs.py)."""
    seen: list[tuple[int, int]] = []
    name = "run_decode" if decode else "run_extend"
    run = getattr(graphs, name)

    def recording(batch):
        seen.append((int(batch.logits_indices.numel()), batch.batch_size))
        return run(batch)

    setattr(graphs, name, recording)
    if decode:
        run_packed = graphs.run_packed

        def recording_packed(flat, lengths, pending_tokens):
            seen.append((lengths[0], lengths[0]))  # one logits row per decoding request
            return run_packed(flat, lengths, pending_tokens)

        graphs.run_packed = recording_packed
    return seen


@pytest.fixture(scope="module")
def looping(tiny_model_factory) -> str:
    """Small weights: greedy output soon repeats itself, so n-gram drafts get kept."""
    return tiny_model_factory("llama", init_std=0.02)


def test_ngram_verify_replays_extend_graphs(looping):
    prompts = copy_prompts(6, seed=3)
    params = SamplingParams(max_tokens=40, **GREEDY)
    plain = LLM(model=looping, **KW).generate(prompts, params)
    llm = LLM(model=looping, **KW, speculative_algorithm="ngram", speculative_num_draft_tokens=4)
    seen = record_runs(llm.engine.runner.graphs)
    spec = llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    s = llm.stats()
    assert s["spec_accepted_tokens"] > 20, s
    verify_replays = [rows for rows, bs in seen if rows > bs]
    assert len(verify_replays) >= 5, seen


def test_draft_model_replays_its_graphs(looping):
    """The target as its own draft, graphs on in both: every draft is kept (stale draft KV
    from a wrong graph input would show as rejections), and both replay graphs."""
    prompts = copy_prompts(5, seed=1)
    params = SamplingParams(max_tokens=45, **GREEDY)
    plain = LLM(model=looping, **KW).generate(prompts, params)
    llm = LLM(model=looping, **KW, speculative_algorithm="draft_model",
              speculative_draft_model=looping, speculative_num_steps=4,
              speculative_num_draft_tokens=4)
    draft_runner = llm.engine.speculator.proposer.runner
    assert draft_runner.graphs is not None and draft_runner.graphs.max_extend_tokens > 0
    draft_decode = record_runs(draft_runner.graphs, decode=True)
    draft_extend = record_runs(draft_runner.graphs)
    target_extend = record_runs(llm.engine.runner.graphs)
    spec = llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    s = llm.stats()
    assert s["spec_drafted_tokens"] > 100 and s["spec_accepted_tokens"] == s["spec_drafted_tokens"]
    assert draft_decode and draft_extend
    assert any(rows > bs for rows, bs in target_extend), target_extend


def test_prompt_logprobs_through_graphs_equal_eager(tiny_llama):
    prompts = [list(range(5, 5 + n)) for n in (3, 40, 200)]
    params = SamplingParams(max_tokens=4, prompt_logprobs_start=1, logprobs=True, **GREEDY)
    outs = {}
    for graphs in (True, False):
        llm = LLM(model=tiny_llama, **KW, enable_cuda_graph=graphs)
        seen = record_runs(llm.engine.runner.graphs) if graphs else []
        outs[graphs] = [llm.generate([p], params)[0] for p in prompts]
        if graphs:  # each prompt's one prefill step replayed a graph (prompt rows and all)
            assert len(seen) == len(prompts), seen
    for a, b in zip(outs[True], outs[False]):
        assert a.token_ids == b.token_ids
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for x, y in zip(a.prompt_logprobs, b.prompt_logprobs):
            assert (x is None and y is None) or abs(x - y) < 1e-4
