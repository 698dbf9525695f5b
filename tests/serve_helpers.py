"""Starting a real local Ray cluster and the radixserve app for tests."""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
# Another port lets two test runs share a machine (each starts its own Ray cluster).
PORT = int(os.environ.get("RADIXSERVE_TEST_PORT", "8000"))
BASE = f"http://127.0.0.1:{PORT}"


# Ray Serve's "high throughput" mode (Ray 2.55+), read from the environment when the Ray
# cluster and Serve start: user code on the replica's event loop, handles' routers on the
# caller's loop, gRPC between replicas, direct ingress, HAProxy in front of the ingress
# replicas (tests/test_serve_throughput_mode.py runs the app and Serve test files under it).
THROUGHPUT_MODE_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}


def private_haproxy_env(directory: Path) -> dict[str, str]:
    """HAProxy's ports, admin socket and files of its own (free ports, files under
    `directory`) instead of Serve's fixed defaults, so a run under the mode shares no port
    or socket with another Serve on this machine. `directory`: a short path (the sockets go
    in a folder per node id under it, and a Unix socket's path may not pass 107 characters)."""
    files = {"CONFIG_FILE_LOC": "haproxy.cfg", "SOCKET_PATH": "admin.sock",
             "SERVER_STATE_FILE": "server-state", "METRICS_SOCKET_PATH": "metrics.sock"}
    env = {f"RAY_SERVE_HAPROXY_{k}": str(directory / v) for k, v in files.items()}
    env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"] = str(directory)
    for name in ("STATS_PORT", "METRICS_PORT"):
        env[f"RAY_SERVE_HAPROXY_{name}"] = str(free_port())
    return env


def readme_mode_env() -> dict[str, str]:
    """The variables scripts/serve.sh sets (scripts/serve_mode.sh: the mode above plus the
    hardened HAProxy and its client timeout), read by sourcing the script itself."""
    import subprocess

    out = subprocess.run(["bash", "-c", 'source scripts/serve_mode.sh && env -0'], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    env = dict(item.split("=", 1) for item in out.split("\0") if "=" in item)
    return {k: v for k, v in env.items() if k.startswith(("RAY_SERVE_", "RADIXSERVE_HAPROXY"))}


def serve_config_args(**overrides) -> dict:
    """The app args of serve_config.yaml, sized for a 2-core test machine."""
    args = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]
    # On the tiny demo model, which starts in seconds; the default real model has its own
    # end-to-end tests (tests/test_real_model_serve.py, tests/test_serve_cli.py).
    args.update(model=None, served_model_name="radixserve-demo")
    args["ray_actor_options"] = {"num_cpus": 0.2}
    # An idle replica then stops in a fifth of a second instead of Serve's 2 s: every app a
    # test deletes pays it.
    args["graceful_shutdown_wait_loop_s"] = 0.2
    args.update(overrides)
    return args


def served_model_name() -> str:
    """The model name that `serve run serve_config.yaml` answers to."""
    return yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"][
        "served_model_name"]


def start_ray() -> None:
    """Join the test session's Ray cluster, starting it on first use. The modules that serve
    in-process share it (and Serve on PORT) one after another: each start and shutdown costs
    15-45 s on a 2-core box. stop_ray() ends a module's apps; end_ray() the cluster."""
    import ray

    if ray.is_initialized():
        _drop_idle_shared_app()
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=8, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})


# The demo app that the plain HTTP files share ("radixserve" on "/"), sized for the most
# demanding of them: 300 concurrent streams + 30 requests (tests/test_serve_path.py) fit
# running + queued. Its replicas start once for all of them (each start costs 15-30 s on a
# 2-core box); conftest.py runs those files one after another. They read its counters as
# deltas and its cache as warm or cold.
SHARED_APP_ENGINE = {"max_running_requests": 64, "chunked_prefill_size": 256,
                     "max_total_tokens": 16384, "max_queued_requests": 512}
_shared = {"up": False, "held": False}


def shared_app() -> None:
    """Serve the shared demo app at BASE for this module: the one already running when an
    earlier module left it healthy, else a fresh deploy. stop_ray() keeps it; the next
    module that starts anything else removes it first."""
    import ray
    from ray import serve

    if _shared["up"] and ray.is_initialized():
        app = serve.status().applications.get("radixserve")
        if app is not None and app.status == "RUNNING":
            _shared["held"] = True
            return
    start_ray()
    run_app(serve_config_args(engine=SHARED_APP_ENGINE))
    _shared.update(up=True, held=True)


def _drop_idle_shared_app() -> None:
    """Delete the shared app when no module holds it, before another module's apps start."""
    from ray import serve

    if _shared["up"] and not _shared["held"]:
        _shared["up"] = False
        serve.delete("radixserve")


def stop_ray() -> None:
    """Delete this module's Serve apps (all but the shared one), keeping the cluster and Serve
    for the next module; a cluster that cannot delete them is ended."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    keep = "radixserve" if _shared["up"] else None
    _shared["held"] = False
    try:
        delete_apps([name for name in serve.status().applications if name != keep])
    except Exception:  # noqa: BLE001 - a broken cluster is not worth keeping
        end_ray()


def delete_apps(names: list[str], timeout: float = 60.0) -> None:
    """Delete Serve apps side by side (their replicas drain at once, not app after app)."""
    from ray import serve

    for name in names:
        serve.delete(name, _blocking=False)
    if not wait_until(lambda: not set(names) & set(serve.status().applications), timeout):
        raise TimeoutError(f"Serve apps {names} still there after {timeout} s")


def end_ray() -> None:
    """End the session's cluster: before a module that starts its own (a multi-node cluster,
    `serve run` or scripts/serve.sh in a subprocess, other Ray options), and at the end."""
    import ray
    from ray import serve

    _shared.update(up=False, held=False)
    if _kept_cluster:
        _kept_cluster.pop("finish")()
        _kept_cluster.clear()
        return
    if ray.is_initialized():
        try:
            serve.shutdown()
        except Exception:  # noqa: BLE001 - a controller already gone; the cluster ends anyway
            pass
        ray.shutdown()


def free_port() -> int:
    """A port free now, from 20000-32767: above Ray's worker ports (10002-19999) and below
    the kernel's ephemeral range (32768+), so none of the sockets a starting Ray cluster
    opens can take it before the server that was given it binds it."""
    import random
    import socket

    for _ in range(200):
        port = random.randint(20000, 32767)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32767")


# Both files' two nodes, kept from one to the other (conftest.py runs them in turn).
TWO_NODE_RESOURCES = {"fake_gpu": 1, "engine_slot": 1}  # test_tp_serve's, test_prefix_fetch_http's
_kept_cluster: dict = {}


def two_node_cluster(request) -> tuple[object, int]:
    """Head (2 CPUs) + worker (1 CPU), each with TWO_NODE_RESOURCES: start_local_cluster,
    kept for the next module that asks for the same nodes."""
    node = {"resources": TWO_NODE_RESOURCES}
    return start_local_cluster(request, {"num_cpus": 2, **node}, {"num_cpus": 1, **node},
                               keep=True)


def start_local_cluster(request, head: dict, *workers: dict,
                        keep: bool = False) -> tuple[object, int]:
    """A multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`: one raylet per
    node), connected, with Serve started on a free port behind one proxy (every node shares
    this machine's ports). `head`, `workers`: each node's `add_node` arguments. Torn down by
    the test's finalizer; with `keep`, the finalizer deletes the Serve apps only, and the
    next call for the same nodes gets the same cluster (anything else ends it first).
    Returns (cluster, port)."""
    import ray
    import ray._private.utils
    from ray import serve
    from ray.cluster_utils import Cluster

    key = repr((head, workers))
    if keep and _kept_cluster.get("key") == key and ray.is_initialized():
        request.addfinalizer(_delete_kept_clusters_apps)
        return _kept_cluster["cluster"], _kept_cluster["port"]
    end_ray()
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

    for worker in workers:
        cluster.add_node(**worker)
    ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    port = free_port()  # not 8000: other test runs on this machine may hold it
    if keep:
        _kept_cluster.update(key=key, cluster=cluster, port=port, finish=finish)
        request.addfinalizer(_delete_kept_clusters_apps)
    else:
        request.addfinalizer(finish)
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    return cluster, port


def _delete_kept_clusters_apps() -> None:
    from ray import serve

    try:
        delete_apps(list(serve.status().applications))
    except Exception:  # noqa: BLE001 - a broken cluster is not worth keeping
        end_ray()


def run_app(args: dict, name: str = "radixserve", route_prefix: str = "/") -> None:
    from ray import serve

    from deployments.app import build_app

    serve.start(http_options={"port": PORT})  # a no-op once Serve runs
    serve.run(build_app(args), name=name, route_prefix=route_prefix)


def deploy_all(apps: list[tuple[str, str, dict]]) -> None:
    """Deploy (name, route prefix, args) apps at once (as `serve run` does a config's
    applications), so their replicas start side by side instead of one after another."""
    from ray import serve
    from ray.serve.api import RunTarget

    from deployments.app import build_app

    serve.start(http_options={"port": PORT})
    serve.run_many([RunTarget(target=build_app(args), name=name, route_prefix=prefix)
                    for name, prefix, args in apps])


def call_deployment(deployment: str, method: str, *args, app: str = "radixserve",
                    timeout: float = 30.0):
    """`method(*args)` on one of `deployment`'s replicas, through a deployment handle, from
    the test driver; works in both Serve modes. Under RAY_SERVE_THROUGHPUT_OPTIMIZED=1 a
    handle's router runs on the caller's event loop (`.remote()` outside a running loop
    raises "No event loop running") and stays bound to the first loop that used it, so every
    call runs on one long-lived loop in a thread of its own (`asyncio.run` per call would
    leave the router on a closed loop)."""
    import asyncio

    from ray import serve

    async def call():
        handle = serve.get_deployment_handle(deployment, app_name=app)
        return await asyncio.wait_for(getattr(handle, method).remote(*args), timeout)

    return asyncio.run_coroutine_threadsafe(call(), _driver_loop()).result(timeout + 5)


_loop = None


def _driver_loop():
    """The test driver's event loop for handle calls (started on first use, a daemon thread)."""
    global _loop
    if _loop is None:
        import asyncio
        import threading

        _loop = asyncio.new_event_loop()
        threading.Thread(target=_loop.run_forever, name="serve-handle-loop", daemon=True).start()
    return _loop


def kill_session(sid: int) -> None:
    """Ray's workers start process groups of their own: end every process of the session."""
    import signal
    import subprocess

    out = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True).stdout
    for line in out.splitlines():
        pid, psid = (int(x) for x in line.split())
        if psid == sid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@contextlib.contextmanager
def serve_run(config: str = "serve_config.yaml", env: dict | None = None):
    """`serve run CONFIG` as a user runs it (a subprocess in its own session, `env` added to
    this environment); yields the process, killed with all of Ray's processes afterwards."""
    import subprocess
    import sys

    end_ray()  # the session's cluster would hold the config's port
    full_env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(ROOT), **(env or {}))
    serve_bin = os.path.join(os.path.dirname(sys.executable), "serve")
    proc = subprocess.Popen([serve_bin, "run", config], cwd=ROOT, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        kill_session(proc.pid)
        proc.wait(timeout=30)
        time.sleep(1)


def wait_for_serve_run(proc, base: str, timeout: float = 150.0) -> None:
    """Wait until `serve run`'s app answers GET /v1/models at `base`; fail with its output."""
    import pytest

    def ready():
        if proc.poll() is not None:
            return "exited"
        try:
            return httpx.get(f"{base}/v1/models", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    state = wait_until(ready, timeout=timeout, interval=1)
    if state != True:  # noqa: E712
        out = proc.stdout.read().decode(errors="replace") if proc.poll() is not None else ""
        pytest.fail(f"serve run did not come up ({state}): {out[-3000:]}")


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def stats() -> dict:
    return httpx.get(f"{BASE}/v1/stats", timeout=30).json()


def leave_a_non_streamed_request(base: str, model: str, n: int, max_tokens: int,
                                 headers: dict | None = None) -> None:
    """Send a non-streamed completion of `n` choices x `max_tokens` (seconds of work on a test
    box), leave it after 0.3 s, and check that the engine aborts all `n` and frees their KV."""
    import pytest

    def read_stats() -> dict:
        return httpx.get(f"{base}/v1/stats", timeout=30, headers=headers).json()

    start = read_stats()
    body = {"model": model, "prompt": "Never ending either", "max_tokens": max_tokens, "n": n,
            "ignore_eos": True, "temperature": 1.0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/completions", json=body, headers=headers,
                   timeout=httpx.Timeout(30, read=0.3))
    # Every choice that reached the engine is aborted; on a loaded box the ingress may not
    # have sent them all before the client left, and those it never sends count as neither.
    after = wait_until(lambda: (s := read_stats())["aborted_requests"] > start["aborted_requests"]
                       and s["running"] == 0 and s["waiting"] == 0 and s, timeout=30)
    if not after or after["finished_requests"] != start["finished_requests"]:
        last = read_stats()
        pytest.fail("the non-streamed request was not aborted after its client left: aborted "
                    f"{last['aborted_requests'] - start['aborted_requests']} of {n}, running "
                    f"{last['running']}, finished {last['finished_requests'] - start['finished_requests']}")
    assert after["free_slots"] + after["evictable_slots"] == after["total_slots"]
