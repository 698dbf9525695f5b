"""The front-end language against the real Serve app (real Ray, real HTTP, the demo model)."""
from __future__ import annotations

import re

import httpx
import pytest

import frontend as sgl
from engine.loading.demo_model import ensure_demo_model
from engine.loading.tokenizer import Tokenizer
from hf_reference import hf_next_logprobs
from serve_helpers import BASE, shared_app, stats, stop_ray

MODEL = "radixserve-demo"


@pytest.fixture(scope="module")
def backend():
    shared_app()
    endpoint = sgl.RuntimeEndpoint(BASE)
    sgl.set_default_backend(endpoint)
    yield endpoint
    stop_ray()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(ensure_demo_model())


@sgl.function
def chat(s, system, question, max_tokens=12):
    s += sgl.system(system)
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=max_tokens, temperature=0, ignore_eos=True))


@sgl.function
def qa(s, question):
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=8, temperature=0))


# -- chat template --------------------------------------------------------------------------


def test_render_endpoint_matches_the_chat_endpoint_tokens(backend, tokenizer):
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi!"}]
    r = httpx.post(f"{BASE}/tokenize", json={"messages": messages}, timeout=30).json()
    assert r["tokens"] == tokenizer.apply_chat_template(messages)
    assert backend.tokenize([r["prompt"]])[0] == r["tokens"]  # no doubled BOS
    markers = backend.chat_markers()
    assert markers.render(messages) + markers.begin("assistant", first=False) == r["prompt"]
    for bad in ({}, {"prompt": "x", "messages": messages}, {"messages": [{"role": "x"}]}):
        assert httpx.post(f"{BASE}/tokenize", json=bad, timeout=30).status_code == 400


def test_chat_program_generates_what_the_chat_endpoint_does(backend):
    state = chat.run(system="You are terse.", question="Tell me a story")
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "system", "content": "You are terse."},
                         {"role": "user", "content": "Tell me a story"}]}
    ref = httpx.post(f"{BASE}/v1/chat/completions", json=body, timeout=60).json()
    assert state["answer"] == ref["choices"][0]["message"]["content"]
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant"]
    assert state.messages()[-1]["content"] == state["answer"]


# -- multi-step programs and the radix cache ------------------------------------------------


def test_multi_step_program_reuses_its_own_prefix(backend):
    @sgl.function
    def two_turns(s):
        s += sgl.system("You answer questions about the harbour and the lighthouse keeper.")
        s += sgl.user("Who climbs the stairs every evening?")
        s += sgl.assistant(sgl.gen("first", max_tokens=10))
        s += sgl.user("And what does the beam do?")
        s += sgl.assistant(sgl.gen("second", max_tokens=10))

    state = two_turns.run(temperature=0, ignore_eos=True)
    first, second = state.get_meta_info("first"), state.get_meta_info("second")
    assert first["completion_tokens"] == second["completion_tokens"] == 10
    # The second request starts with the first's whole prompt: the server had it cached.
    assert second["cached_tokens"] >= first["prompt_tokens"]
    assert state.text().endswith(state["second"] + backend.chat_markers().end("assistant"))


def test_fork_branches_share_the_prefix(backend):
    prefix = ("The old lighthouse stood at the edge of the harbour, and every evening the keeper "
              "climbed the spiral stairs to light the lamp. Here are three tips for keepers:\n")
    prefix_tokens = len(backend.tokenize([prefix])[0])

    @sgl.function
    def tips(s):
        s += prefix
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Tip {i + 1}:" + sgl.gen("tip", max_tokens=8, stop="\n")
        forks.join()
        s += "".join(f"- {f['tip'].strip()}\n" for f in forks)
        return forks

    before = stats()["cached_tokens"]
    state = tips.run(temperature=0.8, seed=7)
    forks = state.ret_value
    branch_meta = [f.get_meta_info("tip") for f in forks]
    assert all(m["cached_tokens"] >= prefix_tokens - 1 for m in branch_meta), branch_meta
    assert stats()["cached_tokens"] - before >= 3 * (prefix_tokens - 1)
    assert all(f.text().startswith(prefix + f"Tip {i + 1}:") for i, f in enumerate(forks))


def test_run_batch_of_sixteen_programs(backend):
    questions = [f"Question {i}: what is {i} plus {i}?" for i in range(16)]
    states = qa.run_batch([{"question": q} for q in questions], num_threads=16)
    assert len(states) == 16
    for q, state in zip(questions, states):
        assert state.error() is None
        assert q in state.text() and state.get_meta_info("answer")["completion_tokens"] >= 1


# -- select ----------------------------------------------------------------------------------


def offline_choice_scores(tokenizer: Tokenizer, prefix: str, choices: list[str]) -> list[float]:
    """Length-normalized log-probability of each choice after `prefix`, with HF transformers."""
    path = ensure_demo_model()
    prefix_ids = tokenizer.encode(prefix)
    scores = []
    for choice in choices:
        ids = tokenizer.encode(prefix + choice)
        start = next((i for i, (a, b) in enumerate(zip(prefix_ids, ids)) if a != b), len(prefix_ids))
        lps = [hf_next_logprobs(path, ids[:j])[ids[j]].item() for j in range(start, len(ids))]
        scores.append(sum(lps) / len(lps))
    return scores


@pytest.mark.parametrize("prefix, choices", [
    ("User: What is the capital of France? Assistant: The capital of France is",
     [" Paris", " London", " a small village by the river"]),
    ("The river runs from the mountains to the", [" sea", " sky", " market square"]),
    ("Numbers are everywhere: one, two, three,", [" four", " seven", " twelve months"]),
])
def test_select_agrees_with_offline_logprobs(backend, tokenizer, prefix, choices):
    @sgl.function
    def pick(s):
        s += prefix + sgl.select("pick", choices=choices)

    state = pick.run()
    ref = offline_choice_scores(tokenizer, prefix, choices)
    got = state.get_meta_info("pick")["normalized_logprobs"]
    assert got == pytest.approx(ref, abs=1e-3)
    assert state["pick"] == choices[max(range(len(ref)), key=ref.__getitem__)]
    assert state.text() == prefix + state["pick"]


def test_select_inside_a_chat(backend):
    @sgl.function
    def yes_no(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.select("verdict", choices=["Yes", "No", "It depends"]))

    state = yes_no.run(question="Is the lighthouse near the rocks?")
    assert state["verdict"] in ("Yes", "No", "It depends")
    assert state.messages()[-1] == {"role": "assistant", "content": state["verdict"]}


# -- streaming, constraints, errors -------------------------------------------------------------


def test_streaming_text_iter(backend):
    state = qa.run(question="Can you tell me a story?", stream=True)
    pieces = list(state.text_iter("answer"))
    assert "".join(pieces) == state["answer"] and len(pieces) > 1
    assert "".join(state.text_iter()) == state.text()
    # Read at once, a streamed run waits for its background program (no race with step one).
    assert qa.run(question="Can you tell me a story?", stream=True)["answer"] == state["answer"]


def test_regex_gen_matches(backend):
    @sgl.function
    def year(s):
        s += "The railway was finished in the year " + sgl.gen("year", regex=r"1[89][0-9]{2}",
                                                                 max_tokens=8, temperature=0.7)

    state = year.run()
    assert re.fullmatch(r"1[89][0-9]{2}", state["year"]), state["year"]


def test_server_errors_are_raised_with_the_servers_message(backend):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": -1}
    expected = httpx.post(f"{BASE}/v1/completions", json=body, timeout=30).json()["error"]["message"]

    @sgl.function
    def bad(s):
        s += "Hello" + sgl.gen("x", max_tokens=4, temperature=-1)
        s += sgl.gen("never", max_tokens=4)  # not run: it would build on the failure

    state = bad.run()
    with pytest.raises(sgl.ServerError) as info:
        state["x"]
    assert info.value.message == expected and info.value.status == 400
    with pytest.raises(sgl.ServerError):
        state.text()
    # A streamed gen fails the same way.
    with pytest.raises(sgl.ServerError, match=re.escape(expected)):
        list(bad.run(stream=True).text_iter())


# -- programs without a server -------------------------------------------------------------------


def test_misuse_is_reported_before_sending_anything():
    with pytest.raises(TypeError, match="qa:"):
        qa.run(backend=sgl.RuntimeEndpoint("http://127.0.0.1:9"), nonsense=1)
    with pytest.raises(ValueError):
        sgl.select("x", choices=[])
    with pytest.raises(TypeError):
        sgl.gen("x", max_tokens=3, max_new_tokens=4)
    with pytest.raises(TypeError):
        sgl.gen("x") + 5  # noqa: B018


def test_unbalanced_roles_fail_the_program():
    @sgl.function
    def broken(s):
        s += sgl.user_end()

    state = broken.run(backend=sgl.RuntimeEndpoint("http://127.0.0.1:9"))
    with pytest.raises(ValueError, match="none is open"):
        state.text()
