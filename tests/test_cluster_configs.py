"""cluster_configs/: KubeRay manifests (fields KubeRay requires, the embedded Serve config
valid for Ray and in sync with serve_config.yaml), the VM cluster launcher config (Ray's
own schema), and the local multi-node script."""
from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "cluster_configs"
APP = "applications.0.args."

# Where each RayService's serveConfigV2 may differ from serve_config.yaml (dotted paths;
# everything below a listed path is free). Each manifest's header comment says why.
DECLARED_OVERRIDES: dict[str, set[str]] = {
    "rayservice-gpu.yaml": {
        APP + "model", APP + "served_model_name", APP + "num_replicas",
        APP + "autoscaling_config", APP + "ray_actor_options", APP + "engine.mem_fraction_static",
    },
    "rayservice-gpu-tp2.yaml": {
        APP + "model", APP + "served_model_name", APP + "num_replicas",
        APP + "autoscaling_config", APP + "ray_actor_options", APP + "engine.mem_fraction_static",
        APP + "engine.tp_size", APP + "placement_group_strategy",
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
    check_pod_template(head["template"], gpus=0)
    assert cluster["workerGroupSpecs"]
    for group in cluster["workerGroupSpecs"]:
        assert group["groupName"] and isinstance(group["rayStartParams"], dict)
        replicas = group.get("replicas", group["minReplicas"])
        assert 0 <= group["minReplicas"] <= replicas <= group["maxReplicas"]
        check_pod_template(group["template"], gpus=1)
    # rayStartParams values are strings in the CRD (map[string]string).
    for params in [head["rayStartParams"]] + [g["rayStartParams"] for g in cluster["workerGroupSpecs"]]:
        assert all(isinstance(v, str) for v in params.values()), params


def check_pod_template(template: dict[str, Any], gpus: int) -> None:
    containers = template["spec"]["containers"]
    assert containers
    ray = containers[0]  # KubeRay runs Ray in the first container
    assert ray["name"] and ray["image"]
    limits, requests = ray["resources"]["limits"], ray["resources"]["requests"]
    assert limits.get("nvidia.com/gpu", 0) == gpus and requests.get("nvidia.com/gpu", 0) == gpus
    assert limits["cpu"] and limits["memory"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert ray[probe]["exec"]["command"], probe


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


def test_tp_variant_spreads_two_ranks():
    args = serve_config("rayservice-gpu-tp2.yaml")["applications"][0]["args"]
    assert args["engine"]["tp_size"] == 2 and args["placement_group_strategy"] == "SPREAD"


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
