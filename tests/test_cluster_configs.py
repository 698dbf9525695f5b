"""cluster_configs/: KubeRay manifests (strictly valid against KubeRay's RayService CRD
schema, the fields and choices docs/deploy.md explains, the embedded Serve config valid for
Ray and in sync with serve_config.yaml), the VM cluster launcher config (Ray's own schema),
and the local multi-node script."""
from __future__ import annotations

import copy
import json
import math
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "cluster_configs"
APP = "applications.0.args."
CRD_SCHEMA = ROOT / "tests" / "data" / "kuberay" / "ray.io_rayservices.v1.schema.json"

# Where each RayService's serveConfigV2 may differ from serve_config.yaml (dotted paths;
# everything below a listed path is free). Each manifest's header comment says why.
DECLARED_OVERRIDES: dict[str, set[str]] = {
    "rayservice-gpu.yaml": {
        APP + "model", APP + "served_model_name", APP + "num_replicas",
        APP + "autoscaling_config", APP + "ray_actor_options", APP + "engine.mem_fraction_static",
        APP + "ingress_ray_actor_options", APP + "engine.max_queued_requests",
        "http_options.host",  # 0.0.0.0 in the pod; serve_config.yaml: this machine only
    },
    "rayservice-gpu-tp2.yaml": {
        APP + "model", APP + "served_model_name", APP + "num_replicas",
        APP + "autoscaling_config", APP + "ray_actor_options", APP + "engine.mem_fraction_static",
        APP + "ingress_ray_actor_options", APP + "engine.max_queued_requests",
        APP + "engine.tp_size", "http_options.host",
    },
}
# App args written ahead of the issue that adds them (tensor parallelism): validated once
# AppArgs knows them, stripped before validation until then.
RAYSERVICES = sorted(DECLARED_OVERRIDES)


def manifest(name: str) -> dict[str, Any]:
    return yaml.safe_load((CONFIGS / name).read_text())


def serve_config(name: str) -> dict[str, Any]:
    return yaml.safe_load(manifest(name)["spec"]["serveConfigV2"])


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """{"a.b.0.c": leaf} for nested dicts and lists."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return {prefix.rstrip("."): value}
    out: dict[str, Any] = {}
    for key, child in items:
        out.update(flatten(child, f"{prefix}{key}."))
    return out


def under(path: str, roots: set[str]) -> bool:
    return any(path == r or path.startswith(r + ".") for r in roots)


def test_every_config_parses():
    files = sorted(CONFIGS.glob("*.y*ml"))
    assert {f.name for f in files} >= set(RAYSERVICES) | {"ray-cluster-vms.yaml"}
    for f in files:
        assert yaml.safe_load(f.read_text()), f


@pytest.mark.parametrize("name", RAYSERVICES)
def test_rayservice_has_the_fields_kuberay_requires(name):
    doc = manifest(name)
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayService"
    assert doc["metadata"]["name"]
    spec = doc["spec"]
    assert isinstance(spec["serveConfigV2"], str)  # KubeRay takes the Serve config as text
    cluster = spec["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    head = cluster["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    assert head["rayStartParams"].get("num-gpus") == "0"
    check_pod_template(head["template"], gpus=0, worker=False)
    assert cluster["workerGroupSpecs"]
    for group in cluster["workerGroupSpecs"]:
        assert group["groupName"] and isinstance(group["rayStartParams"], dict)
        replicas = group.get("replicas", group["minReplicas"])
        assert 0 <= group["minReplicas"] <= replicas <= group["maxReplicas"]
        tp = yaml.safe_load(spec["serveConfigV2"])["applications"][0]["args"]["engine"].get("tp_size", 1)
        check_pod_template(group["template"], gpus=tp, worker=True)  # a replica's ranks share one pod
    # rayStartParams values are strings in the CRD (map[string]string).
    for params in [head["rayStartParams"]] + [g["rayStartParams"] for g in cluster["workerGroupSpecs"]]:
        assert all(isinstance(v, str) for v in params.values()), params


def check_pod_template(template: dict[str, Any], gpus: int, worker: bool) -> None:
    containers = template["spec"]["containers"]
    assert containers
    ray = containers[0]  # KubeRay runs Ray in the first container
    assert ray["name"] and ray["image"]
    limits, requests = ray["resources"]["limits"], ray["resources"]["requests"]
    assert limits.get("nvidia.com/gpu", 0) == gpus and requests.get("nvidia.com/gpu", 0) == gpus
    assert limits["cpu"] and limits["memory"]
    # KubeRay injects a probe only where the container has none of that kind: liveness (the
    # raylet) stays KubeRay's everywhere, so a starting engine never gets a pod restarted;
    # the head's readiness is KubeRay's too (it does not take Serve traffic through it).
    assert "livenessProbe" not in ray
    if not worker:
        assert "readinessProbe" not in ray


# KubeRay's own readiness checks of a RayService worker (ray-operator's BaseWgetHealthCommand
# on the dashboard agent's raylet health and the Serve proxy's /-/healthz), which a probe of
# ours replaces and so must repeat.
KUBERAY_WORKER_CHECKS = ("http://localhost:52365/api/local_raylet_healthz | grep success",
                         "/-/healthz | grep success")


@pytest.mark.parametrize("name", RAYSERVICES)
def test_worker_readiness_probe_is_kuberays_plus_the_apps_health(name):
    """A worker pod is ready when KubeRay's checks pass and the app's /health (the endpoint
    that agrees with /v1/models: 503 while no engine replica can serve) answers 200 on the
    Serve port; one failure takes it out of the Service, as KubeRay's own probe does."""
    from deployments.auth import OPEN_PATHS
    from deployments.readiness import needs_engine

    port = serve_config(name)["http_options"]["port"]
    for group in manifest(name)["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        probe = group["template"]["spec"]["containers"][0]["readinessProbe"]
        assert probe["exec"]["command"][:2] == ["bash", "-c"]
        checks = [c.strip() for c in probe["exec"]["command"][2].split("&&")]
        assert [k for k in KUBERAY_WORKER_CHECKS if not any(k in c for c in checks)] == []
        assert any(f"localhost:{port}/-/healthz" in c for c in checks)
        app = [c for c in checks if c.split()[-1].endswith("/health")]
        assert app == [f"wget --tries 1 -T 2 -q -O /dev/null http://localhost:{port}/health"]
        assert probe["failureThreshold"] == 1 and probe["timeoutSeconds"] >= 3 * 2
    assert needs_engine("GET", "/health") and "/health" in OPEN_PATHS  # no API key needed


def strict(schema: Any) -> Any:
    """The CRD schema with unknown fields rejected: every object schema that lists its
    properties and allows no extra ones (no additionalProperties, no
    x-kubernetes-preserve-unknown-fields) gets additionalProperties: false, as the API
    server's strict field validation (kubectl apply --validate=strict) does."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def crd_validator():
    import jsonschema

    schema = strict(json.loads(CRD_SCHEMA.read_text()))
    return jsonschema.Draft7Validator(schema)


@pytest.mark.parametrize("name", RAYSERVICES)
def test_rayservice_is_strictly_valid_against_kuberays_crd(name, crd_validator):
    errors = sorted(crd_validator.iter_errors(manifest(name)), key=lambda e: list(e.path))
    assert not errors, [f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors]


def test_strict_crd_validation_rejects_unknown_and_mistyped_fields(crd_validator):
    doc = manifest("rayservice-gpu.yaml")
    bad = copy.deepcopy(doc)
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["minReplica"] = 1  # typo
    assert not crd_validator.is_valid(bad)
    bad = copy.deepcopy(doc)
    bad["spec"]["upgradeStrategy"]["type"] = 3
    assert not crd_validator.is_valid(bad)
    bad = copy.deepcopy(doc)
    bad["spec"]["rayClusterConfig"]["autoscalerOptions"]["version"] = "v3"
    assert not crd_validator.is_valid(bad)
    bad = copy.deepcopy(doc)
    bad["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["imag"] = "x"
    assert not crd_validator.is_valid(bad)


@pytest.mark.parametrize("name", RAYSERVICES)
def test_rayservice_upgrade_strategy_and_autoscaler_v2(name):
    spec = manifest(name)["spec"]
    assert spec["upgradeStrategy"]["type"] in ("NewCluster", "NewClusterWithIncrementalUpgrade", "None")
    cluster = spec["rayClusterConfig"]
    assert cluster["autoscalerOptions"]["version"] == "v2"
    for group in cluster["workerGroupSpecs"]:  # autoscaler v2: a pod is one Ray node's life
        assert group["template"]["spec"]["restartPolicy"] == "Never"


@pytest.mark.parametrize("name", RAYSERVICES)
def test_concurrency_limits_in_a_sane_ratio_to_the_target(name):
    """Serve adds replicas at target_ongoing_requests; a replica takes up to
    max_ongoing_requests. Far above the target, a burst piles into the old replicas' engine
    queues while new ones start; at or below the engine's batch, the target is reached only
    with requests queued."""
    from deployments.config import AppArgs

    args = AppArgs.model_validate(serve_config(name)["applications"][0]["args"])
    target = args.autoscaling_config["target_ongoing_requests"]
    running = args.engine["max_running_requests"]
    assert target <= running
    assert target < args.engine_max_ongoing() <= 2.5 * target
    # Two ingress replicas per engine replica, autoscaled with it, never fewer than two.
    ingress = args.ingress_scaling()
    assert ingress["num_replicas"] == "auto"
    auto = ingress["autoscaling_config"]
    assert auto["min_replicas"] >= 2 and auto["max_replicas"] == 2 * args.autoscaling_config["max_replicas"]
    assert args.ingress_ray_actor_options["num_cpus"] >= 1
    # The router's imbalance threshold sits below the target (deployments/config.py).
    assert args.router.request_router_kwargs["abs_threshold"] < target


@pytest.mark.parametrize("name", RAYSERVICES)
def test_worker_pods_have_room_for_the_ingress_replicas(name):
    args = serve_config(name)["applications"][0]["args"]
    container = manifest(name)["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    cpus = float(container["resources"]["limits"]["cpu"])
    tp = args["engine"].get("tp_size", 1)
    # The head runs no replicas (num-cpus 0): per engine replica, its ranks' CPUs (rank 0's
    # ray_actor_options, 1 for every other rank) and two ingress replicas fit in its pod.
    need = args["ray_actor_options"]["num_cpus"] + (tp - 1) + 2 * args["ingress_ray_actor_options"]["num_cpus"]
    assert need <= cpus and math.isfinite(need)


@pytest.mark.parametrize("name", RAYSERVICES)
def test_serve_config_v2_validates_with_rays_schema(name):
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(serve_config(name))


@pytest.mark.parametrize("name", RAYSERVICES)
def test_serve_config_v2_does_not_drift_from_serve_config_yaml(name):
    ours = flatten(yaml.safe_load((ROOT / "serve_config.yaml").read_text()))
    theirs = flatten(serve_config(name))
    allowed = DECLARED_OVERRIDES[name]
    keep_ours = {k: v for k, v in ours.items() if not under(k, allowed)}
    keep_theirs = {k: v for k, v in theirs.items() if not under(k, allowed)}
    assert keep_theirs == keep_ours
    for root in allowed:  # no stale declaration: each override is really used
        assert any(under(k, {root}) for k in theirs) or any(under(k, {root}) for k in ours), root


@pytest.mark.parametrize("name", RAYSERVICES)
def test_app_args_build_a_serve_app(name):
    from deployments.app import build_app
    from deployments.config import AppArgs

    args = copy.deepcopy(serve_config(name)["applications"][0]["args"])
    assert set(args) <= set(AppArgs.model_fields), "every manifest arg is an AppArgs field"
    app = build_app(args)  # validates args and Serve's deployment options (autoscaling)
    assert app is not None
    from ray.serve.config import AutoscalingConfig

    auto = args["autoscaling_config"]
    assert set(auto) <= set(AutoscalingConfig.model_fields), "Serve ignores unknown keys silently"
    assert 1 <= auto["min_replicas"] <= auto["max_replicas"] and auto["target_ongoing_requests"] > 0


@pytest.mark.parametrize("name", RAYSERVICES)
def test_gpu_pods_fit_the_engine_replicas(name):
    args = serve_config(name)["applications"][0]["args"]
    tp = args["engine"].get("tp_size", 1)
    auto = args["autoscaling_config"]
    group = manifest(name)["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    gpus_per_pod = group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert group["maxReplicas"] * gpus_per_pod >= auto["max_replicas"] * tp
    assert group["minReplicas"] * gpus_per_pod >= auto["min_replicas"] * tp


def test_tp_variant_keeps_a_replicas_ranks_in_one_pod():
    args = serve_config("rayservice-gpu-tp2.yaml")["applications"][0]["args"]
    assert args["engine"]["tp_size"] == 2
    assert args.get("placement_group_strategy", "STRICT_PACK") == "STRICT_PACK"
    group = manifest("rayservice-gpu-tp2.yaml")["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2


def test_vm_cluster_config_validates_with_rays_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((CONFIGS / "ray-cluster-vms.yaml").read_text())
    validate_config(prepare_config(config))
    assert config["available_node_types"][config["head_node_type"]]["resources"] == {"CPU": 0}


def test_local_multinode_script_is_valid_bash_and_prints_usage():
    script = CONFIGS / "local_multinode.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert usage.returncode == 2 and "ray start" not in usage.stderr
    assert "worker HEAD_IP" in usage.stdout


# -- Serve's high-throughput mode, as the README's command runs it ------------------------------


def serve_mode() -> dict[str, str]:
    """The RAY_SERVE_* variables scripts/serve_mode.sh exports (sourced in a clean bash),
    with the HAProxy wrapper's path relative to the repository."""
    out = subprocess.run(["bash", "-c", "source scripts/serve_mode.sh && env -0"], cwd=ROOT,
                         env={"PATH": os.environ["PATH"]}, capture_output=True, text=True, check=True).stdout
    env = dict(item.split("=", 1) for item in out.split("\0") if item.startswith("RAY_SERVE_"))
    env["RAY_SERVE_HAPROXY_BINARY_PATH"] = str(Path(env["RAY_SERVE_HAPROXY_BINARY_PATH"]).relative_to(ROOT))
    return env


def test_serve_sh_runs_the_mode_the_cluster_configs_run():
    from serve_helpers import THROUGHPUT_MODE_ENV

    mode = serve_mode()
    assert THROUGHPUT_MODE_ENV.items() <= mode.items()
    assert mode["RAY_SERVE_HAPROXY_BINARY_PATH"] == "scripts/haproxy_hardened.sh"
    assert 'source "$(dirname "${BASH_SOURCE[0]}")/serve_mode.sh"' in (ROOT / "scripts/serve.sh").read_text()


@pytest.mark.parametrize("name", RAYSERVICES)
def test_rayservice_pods_run_serve_in_the_readmes_mode(name):
    """Serve reads the mode's variables when Ray starts: every pod that runs Ray (head and
    workers, whose proxies and replicas Serve starts there) has them in its Ray container,
    the HAProxy wrapper at its path in the image (cluster_configs/Dockerfile's WORKDIR)."""
    workdir = re.search(r"^WORKDIR (\S+)$", (CONFIGS / "Dockerfile").read_text(), re.M).group(1)
    want = serve_mode()
    want["RAY_SERVE_HAPROXY_BINARY_PATH"] = f"{workdir}/{want['RAY_SERVE_HAPROXY_BINARY_PATH']}"
    cluster = manifest(name)["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for template in templates:
        env = template["spec"]["containers"][0]["env"]
        assert {e["name"]: e["value"] for e in env if e["name"].startswith("RAY_SERVE_")} == want


def test_vm_cluster_starts_every_node_in_the_readmes_mode():
    config = yaml.safe_load((CONFIGS / "ray-cluster-vms.yaml").read_text())
    [(remote, local)] = config["file_mounts"].items()
    assert local == "."  # this checkout, where scripts/serve_mode.sh is
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in config[key] if "ray start" in c]
        assert starts and all(c.startswith(f"source {remote}/scripts/serve_mode.sh && ray start")
                              for c in starts), starts


def test_local_multinode_script_starts_nodes_in_the_readmes_mode():
    script = (CONFIGS / "local_multinode.sh").read_text()
    assert script.index("\nsource scripts/serve_mode.sh\n") < script.index("    ray start --")


def test_app_metrics_are_scraped_through_the_serve_service_once():
    """/metrics answers for every replica: one static target, the Serve Service of the
    RayService (KubeRay names it <name>-serve-svc), never a per-pod monitor."""
    doc = yaml.safe_load((CONFIGS / "prometheus-scrapeconfig.yaml").read_text())
    assert doc["apiVersion"] == "monitoring.coreos.com/v1alpha1" and doc["kind"] == "ScrapeConfig"
    spec = doc["spec"]
    assert spec["metricsPath"] == "/metrics"
    [static] = spec["staticConfigs"]
    [target] = static["targets"]
    service = manifest("rayservice-gpu.yaml")["metadata"]["name"] + "-serve-svc"
    port = yaml.safe_load(manifest("rayservice-gpu.yaml")["spec"]["serveConfigV2"])["http_options"]["port"]
    assert target.split(".")[0] == service and target.endswith(f":{port}")
