"""Starting a real local Ray cluster and the radixserve app for tests."""
from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
# Another port lets two test runs share a machine (each starts its own Ray cluster).
PORT = int(os.environ.get("RADIXSERVE_TEST_PORT", "8000"))
BASE = f"http://127.0.0.1:{PORT}"


def serve_config_args(**overrides) -> dict:
    """The app args of serve_config.yaml, sized for a 2-core test machine."""
    args = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]
    # On the tiny demo model, which starts in seconds; the default real model has its own
    # end-to-end tests (tests/test_real_model_serve.py, tests/test_serve_cli.py).
    args.update(model=None, served_model_name="radixserve-demo")
    args["ray_actor_options"] = {"num_cpus": 0.2}
    args.update(overrides)
    return args


def served_model_name() -> str:
    """The model name that `serve run serve_config.yaml` answers to."""
    return yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"][
        "served_model_name"]


def start_ray() -> None:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=8, include_dashboard=False, ignore_reinit_error=True,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_cluster(request, head: dict, *workers: dict) -> tuple[object, int]:
    """A multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`: one raylet per
    node), connected, with Serve started on a free port behind one proxy (every node shares
    this machine's ports). `head`, `workers`: each node's `add_node` arguments. Torn down by
    the test's finalizer. Returns (cluster, port)."""
    import ray
    import ray._private.utils
    from ray import serve
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Cluster records its head as "the latest cluster" (/tmp/ray/ray_current_cluster), which
    # a plain ray.init() elsewhere on this machine would then join: put the old one back.
    address_file = Path(ray._private.utils.get_ray_address_file(None))
    previous = address_file.read_text() if address_file.exists() else None
    cluster = Cluster(initialize_head=True, head_node_args={**head, "include_dashboard": False})

    def restore_address_file() -> None:
        if previous is None:
            address_file.unlink(missing_ok=True)
        else:
            address_file.write_text(previous)

    restore_address_file()

    def finish() -> None:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()
            restore_address_file()

    request.addfinalizer(finish)
    for worker in workers:
        cluster.add_node(**worker)
    ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    port = free_port()  # not 8000: other test runs on this machine may hold it
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    return cluster, port


def run_app(args: dict, name: str = "radixserve", route_prefix: str = "/") -> None:
    from ray import serve

    from deployments.app import build_app

    serve.start(http_options={"port": PORT})  # a no-op once Serve runs
    serve.run(build_app(args), name=name, route_prefix=route_prefix)


def stop_ray() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def stats() -> dict:
    return httpx.get(f"{BASE}/v1/stats", timeout=30).json()
