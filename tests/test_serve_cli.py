"""`serve run serve_config.yaml` as a user runs it: a subprocess that comes up and answers."""
from __future__ import annotations

import httpx
import pytest

from serve_helpers import serve_run as serve_run_process
from serve_helpers import served_model_name, wait_for_serve_run


@pytest.fixture
def serve_run():
    with serve_run_process() as proc:
        yield proc


def test_serve_run_comes_up_and_answers(serve_run):
    wait_for_serve_run(serve_run, "http://127.0.0.1:8000")
    r = httpx.post("http://127.0.0.1:8000/v1/completions", timeout=60,
                   json={"model": served_model_name(), "prompt": "Hello", "max_tokens": 5})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
