"""Request priorities in the engine: admission order, preemption of lower-priority running
requests when the batch is full (rows or KV memory), outputs unchanged by it (greedy and
seeded sampling, sync and overlapped steps), no KV slot leaked; how priorities combine with
`schedule_policy`; the settings' validation."""
from __future__ import annotations

import time

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.core.admission import AdmissionOrder
from engine.runtime.engine import Engine
from engine.runtime.overlap import OverlapStepper
from engine.core.request import Request
from test_engine import assert_slots_accounted, random_prompts
from test_overlap import overlapped

GREEDY = dict(temperature=0.0, ignore_eos=True)


def seeded(i: int) -> dict:
    return dict(temperature=1.0, seed=1000 + i, ignore_eos=True)


def engine(path: str, **kw) -> Engine:
    return Engine(EngineConfig(model=path, dtype="float32", **kw))


def run_recording_admissions(eng: Engine) -> list[str]:
    """Step until idle; the request ids in the order they were first admitted."""
    order: list[str] = []
    while eng.has_work:
        eng.step()
        for req in eng.scheduler.running:
            if req.request_id not in order:
                order.append(req.request_id)
        assert_slots_accounted(eng)
    assert_slots_accounted(eng, idle=True)
    return order


def reference(path: str, prompts, params, device: str = "cpu") -> list[list[int]]:
    """The requests in a roomy engine: never preempted."""
    llm = LLM(model=path, dtype="float32", max_total_tokens=4096, device=device)
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_full_batch_admits_the_higher_priority_first_and_preempts(tiny_llama, sampling):
    """Two low-priority requests fill the batch, two more wait; a high-priority request
    arriving last retracts the newest running one and is admitted at once, before the
    waiting ones. Everyone finishes with the tokens of an unpreempted run."""
    eng = engine(tiny_llama, max_total_tokens=1024, max_running_requests=2)
    prompts = random_prompts(5, 8, 20, seed=21)
    params = [SamplingParams(max_tokens=12, priority=0 if i < 4 else -1,
                             **(GREEDY if sampling == "greedy" else seeded(i)))
              for i in range(5)]
    reqs = [eng.add_request(f"low{i}", prompts[i], params[i]) for i in range(2)]
    for _ in range(3):
        eng.step()  # both running, a few tokens each
    reqs += [eng.add_request(f"low{i}", prompts[i], params[i]) for i in (2, 3)]
    reqs.append(eng.add_request("high", prompts[4], params[4]))
    eng.step()
    running = {r.request_id for r in eng.scheduler.running}
    assert running == {"low0", "high"}, running  # low1, the newest running, was retracted
    order = run_recording_admissions(eng)
    assert order.index("high") < order.index("low2") < order.index("low3")
    assert reqs[1].num_preemptions == 1 and reqs[0].num_preemptions == 0
    stats = eng.stats()
    assert stats["priority_preemptions"] == stats["preemptions"] == 1
    assert [r.output_ids for r in reqs] == reference(tiny_llama, prompts, params)


def test_preemption_for_memory_retracts_the_lowest_priority_first(tiny_llama):
    """Rows are free but KV is short: the high-priority request retracts the lowest
    priority (not the newest) running requests until its first chunk fits."""
    eng = engine(tiny_llama, max_total_tokens=160, chunked_prefill_size=128,
                 enable_radix_cache=False)
    prompts = random_prompts(4, 40, 40, seed=22)
    params = [SamplingParams(max_tokens=8, priority=p, **GREEDY) for p in (5, 1, 3, -2)]
    reqs = [eng.add_request(f"r{i}", prompts[i], params[i]) for i in range(3)]
    eng.step()  # 3 x 40 tokens of 160 slots
    assert len(eng.scheduler.running) == 3
    reqs.append(eng.add_request("high", prompts[3], params[3]))
    eng.step()
    assert {r.request_id for r in eng.scheduler.running} == {"r1", "r2", "high"}
    assert reqs[0].num_preemptions == 1
    run_recording_admissions(eng)
    assert [r.output_ids for r in reqs] == reference(tiny_llama, prompts, params)


def test_equal_or_lower_priorities_never_preempt(tiny_llama):
    """A full batch and a waiting request of the same priority: it waits (fcfs), as it
    would with no priorities at all."""
    eng = engine(tiny_llama, max_total_tokens=1024, max_running_requests=1)
    first = eng.add_request("first", [5, 6, 7, 8], SamplingParams(max_tokens=6, priority=2, **GREEDY))
    eng.step()
    eng.add_request("same", [9, 10, 11], SamplingParams(max_tokens=6, priority=2, **GREEDY))
    eng.add_request("lower", [9, 10, 12], SamplingParams(max_tokens=6, priority=7, **GREEDY))
    assert run_recording_admissions(eng) == ["first", "same", "lower"]
    assert first.num_preemptions == 0 and eng.stats()["preemptions"] == 0


def test_order_mode_admits_by_priority_without_preempting(tiny_llama):
    eng = engine(tiny_llama, max_total_tokens=1024, max_running_requests=1,
                 priority_scheduling="order")
    eng.add_request("first", [5, 6, 7, 8], SamplingParams(max_tokens=6, priority=3, **GREEDY))
    eng.step()
    eng.add_request("low", [9, 10, 11], SamplingParams(max_tokens=6, priority=3, **GREEDY))
    eng.add_request("high", [9, 10, 12], SamplingParams(max_tokens=6, priority=-3, **GREEDY))
    assert run_recording_admissions(eng) == ["first", "high", "low"]
    assert eng.stats()["preemptions"] == 0


def test_off_mode_refuses_priorities(tiny_llama):
    eng = engine(tiny_llama, max_total_tokens=256, priority_scheduling="off")
    with pytest.raises(ValueError, match="priority_scheduling is 'off'"):
        eng.add_request("a", [5, 6], SamplingParams(max_tokens=2, priority=1))
    eng.add_request("b", [5, 6], SamplingParams(max_tokens=2, priority=0))  # the default is fine


def high_priority_arrivals(eng: Engine, seed: int, max_tokens: int
                           ) -> tuple[list[Request], list[list[int]], list[SamplingParams]]:
    """Three requests of priority 4 fill a batch of three; a few steps later three of
    priorities -2, -1 and 0 arrive (greedy and seeded sampling alternate). Returns the
    requests, prompts and params."""
    prompts = random_prompts(6, 6, 24, seed=seed)
    params = [SamplingParams(max_tokens=max_tokens, priority=4 if i < 3 else i - 5,
                             **(GREEDY if i % 2 else seeded(i))) for i in range(6)]
    reqs = [eng.add_request(f"low{i}", prompts[i], params[i]) for i in range(3)]
    for _ in range(3):
        eng.step()
    reqs += [eng.add_request(f"high{i}", prompts[i], params[i]) for i in range(3, 6)]
    return reqs, prompts, params


def test_overlapped_steps_preempt_with_tokens_in_flight(tiny_llama):
    """The overlap scheduler's loop (on CPU): running requests have a token in flight
    when a high-priority arrival retracts them; outputs still equal an unpreempted run."""
    eng = engine(tiny_llama, max_total_tokens=1024, max_running_requests=3)
    overlapped(eng)
    reqs, prompts, params = high_priority_arrivals(eng, seed=23, max_tokens=10)
    order = run_recording_admissions(eng)
    assert order == ["high3", "high4", "high5", "low0", "low1", "low2"]
    assert eng.stats()["priority_preemptions"] == 3
    assert [r.output_ids for r in reqs] == reference(tiny_llama, prompts, params)


class _Cache:
    """match_len: how many leading 1s the prompt has (a stand-in radix tree's answer)."""

    enabled = True

    @staticmethod
    def match_len(tokens: list[int], namespace: int = 0) -> int:
        return next((i for i, t in enumerate(tokens) if t != 1), len(tokens))


def test_priority_comes_before_the_schedule_policy():
    """fcfs: queue order within a priority; lpm: the longest cached prefix within one."""
    reqs = {name: Request(name, tokens, SamplingParams(priority=p)) for name, tokens, p in [
        ("a", [2, 2], 1), ("b", [1, 1, 2], 1), ("c", [1, 2], 0), ("d", [2], 0), ("e", [1, 1, 1], 1)]}
    queue = list(reqs.values())

    def names(policy: str, by_priority: bool = True) -> list[str]:
        order = AdmissionOrder(policy, _Cache(), by_priority=by_priority)
        order.saw_priority = True  # (the scheduler sets it when such a request is queued)
        return [r.request_id for r in order(queue)]

    assert names("fcfs") == ["c", "d", "a", "b", "e"]
    assert names("lpm") == ["c", "d", "e", "b", "a"]
    assert names("fcfs", by_priority=False) == list("abcde")


def test_lpm_with_priorities_matches_unpreempted_outputs(tiny_llama):
    """lpm + priority preemption on a real tree: the same tokens as a roomy fcfs run."""
    shared = random_prompts(1, 30, 30, seed=24)[0]
    prompts = [shared + p for p in random_prompts(6, 3, 8, seed=25)]
    params = [SamplingParams(max_tokens=8, priority=(i * 5) % 3, **GREEDY) for i in range(6)]
    eng = engine(tiny_llama, max_total_tokens=1024, max_running_requests=2, schedule_policy="lpm")
    reqs = []
    for i in range(6):
        reqs.append(eng.add_request(f"r{i}", prompts[i], params[i]))
        eng.step()
    run_recording_admissions(eng)
    assert eng.stats()["priority_preemptions"] > 0
    assert [r.output_ids for r in reqs] == reference(tiny_llama, prompts, params)


@pytest.mark.parametrize("bad", [1.5, "1", True, None])
def test_priority_must_be_an_integer(bad):
    with pytest.raises(ValueError, match="priority must be an integer"):
        SamplingParams(priority=bad)


def test_priority_scheduling_setting_is_checked():
    with pytest.raises(ValueError, match="priority_scheduling"):
        EngineConfig(priority_scheduling="lowest")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_overlap_scheduler_preempts_and_times_out(tiny_llama):
    """On CUDA the engine steps with the overlap scheduler and CUDA graphs: high-priority
    arrivals retract running requests with tokens in flight, whose outputs stay unchanged
    (greedy and seeded), and a queued request past its deadline ends unrun."""
    eng = engine(tiny_llama, device="cuda", max_total_tokens=2048, max_running_requests=3,
                 cuda_graph_max_bs=8)
    assert isinstance(eng.stepper, OverlapStepper)
    reqs, prompts, params = high_priority_arrivals(eng, seed=26, max_tokens=24)
    late = eng.add_request("late", [5, 6, 7], SamplingParams(max_tokens=4, priority=9,
                                                             queue_timeout_s=0.05))
    eng.step()
    time.sleep(0.1)
    order = run_recording_admissions(eng)
    assert order == ["high3", "high4", "high5", "low0", "low1", "low2"]
    assert late.finish_reason == "queue_timeout" and not late.admitted_once
    stats = eng.stats()
    assert stats["priority_preemptions"] == 3 and stats["queue_timeouts"] == 1
    assert [r.output_ids for r in reqs] == reference(tiny_llama, prompts, params, "cuda")
