"""KubeRay manifests: valid against KubeRay's own CRD schemas and Kubernetes' schemas, in
sync with the generator, and carrying a Serve config that passes `rayattn check`."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from rayattn.config.loader import rayattn_apps
from rayattn.config.plan import build_plan
from rayattn.k8s.render import render_all

ROOT = Path(__file__).resolve().parents[3]
# KubeRay's CRDs are not part of this repository: CI points at its copy (.ci/run).
_CRDS = os.environ.get("RAYATTN_KUBERAY_CRDS")
SHARED = Path(_CRDS) if _CRDS else None
needs_crds = pytest.mark.skipif(
    SHARED is None, reason="RAYATTN_KUBERAY_CRDS (a directory of KubeRay CRD YAMLs) is not set")


def test_crd_directory_exists_where_set():
    # Set but wrong must fail loudly, not skip: CI would otherwise pass without the check.
    if SHARED is None:
        pytest.skip("RAYATTN_KUBERAY_CRDS is not set")
    assert SHARED.is_dir(), f"RAYATTN_KUBERAY_CRDS={SHARED} is not a directory"
K8S_VERSION = "1.33.0"


def crd_schema(name: str) -> dict:
    doc = yaml.safe_load((SHARED / name).read_text())
    v1 = next(v for v in doc["spec"]["versions"] if v["name"] == "v1")
    return v1["schema"]["openAPIV3Schema"]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {f: list(yaml.safe_load_all(t)) for f, t in render_all(ROOT).items()}


def test_checked_in_files_equal_generator_output():
    for fname, text in render_all(ROOT).items():
        assert (ROOT / "k8s" / fname).read_text() == text, f"k8s/{fname} drifted; regenerate"


@needs_crds
@pytest.mark.parametrize("name", ["deepseek", "qwen3", "llama"])
def test_rayservice_valid_against_kuberay_crds(rendered, name):
    svc = rendered[f"{name}.yaml"][0]
    jsonschema.validate(svc, crd_schema("ray.io_rayservices.yaml"))
    cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster",
               "metadata": {"name": svc["metadata"]["name"]},
               "spec": svc["spec"]["rayClusterConfig"]}
    jsonschema.validate(cluster, crd_schema("ray.io_rayclusters.yaml"))
    # The pod templates are core Kubernetes PodTemplateSpecs.
    groups = [svc["spec"]["rayClusterConfig"]["headGroupSpec"],
              *svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]]
    for g in groups:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
               "spec": g["template"]["spec"]}
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


@needs_crds
def test_schema_validation_catches_a_broken_manifest(rendered):
    bad = copy.deepcopy(rendered["llama.yaml"][0])
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, crd_schema("ray.io_rayservices.yaml"))


@pytest.mark.parametrize("name,nodes,max_nodes,gpus,backend", [
    ("deepseek", 1, 1, "8", "ROCM_AITER_TRITON_MLA"),
    ("qwen3", 1, 1, "8", "ROCM_AITER_FA"),
    # 2..8 autoscaled replicas of TP4: two per 8-GPU node, so one node to four
    ("llama", 1, 4, "8", "ROCM_AITER_FA"),
])
def test_sizing_env_and_embedded_serve_config(rendered, name, nodes, max_nodes, gpus,
                                              backend):
    svc = rendered[f"{name}.yaml"][0]
    serve_cfg = yaml.safe_load(svc["spec"]["serveConfigV2"])
    (_, cfg), = rayattn_apps(serve_cfg)
    plan = build_plan(cfg)  # the embedded serve config passes `rayattn check`
    assert plan.backend.name == backend
    wg = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert wg["replicas"] == wg["minReplicas"] == nodes and wg["maxReplicas"] == max_nodes
    # Ray's autoscaler runs exactly when Serve may add engine replicas that need new nodes.
    assert svc["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] == (max_nodes > nodes)
    c = wg["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["amd.com/gpu"] == gpus
    env = {e["name"]: e for e in c["env"]}
    assert env["VLLM_ROCM_USE_AITER"]["value"] == "1"
    assert env["RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES"]["value"] == "1"
    assert "valueFrom" in env["HF_TOKEN"] and "value" not in env["HF_TOKEN"]
    head = svc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "amd.com/gpu" not in head["resources"]["limits"]
    assert svc["spec"]["upgradeStrategy"]["type"] == "NewCluster"
    shm = next(v for v in wg["template"]["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"


def test_monitoring_dashboard_and_rules(rendered):
    cm = rendered["grafana-dashboard.yaml"][0]
    kubernetes_validate.validate(cm, K8S_VERSION, strict=True)
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    monitors = rendered["monitoring.yaml"]
    assert {m["spec"]["selector"]["matchLabels"]["ray.io/node-type"] for m in monitors} == {
        "head", "worker"}
    rule = rendered["prometheus-rules.yaml"][0]
    assert rule["kind"] == "PrometheusRule" and rule["spec"]["groups"][0]["rules"]


@needs_crds
def test_pod_monitors_match_kuberay_reference(rendered):
    reference = list(yaml.safe_load_all((SHARED / "podMonitor.yaml").read_text()))
    assert {m["kind"] for m in rendered["monitoring.yaml"]} == {r["kind"] for r in reference}


def test_worker_pods_request_the_engines_offload_tiers():
    from rayattn.k8s.render import worker_memory_gib

    (_, cfg), = rayattn_apps(yaml.safe_load((ROOT / "deployments" / "llama.yaml").read_text()))
    cfg.engine.kv_offload.size_gib = 600  # two TP4 engines per node × 600 GiB
    cfg.platform.host_memory_gib = 2048
    request, limit = worker_memory_gib([build_plan(cfg)])
    assert (request, limit) == (32 * 8 + 1200, 2048)
    cfg.engine.kv_offload.size_gib = 0
    assert worker_memory_gib([build_plan(cfg)]) == (1024, 2048)


@pytest.mark.parametrize("name", ["deepseek", "qwen3", "llama"])
def test_manifests_expose_only_the_api_and_keep_keys_off_engine_pods(rendered, name):
    """Issue 25, item 4: before, any pod could reach the Ray dashboard / job API (8265 on
    0.0.0.0, no NetworkPolicy) and submit a job, and every container held the API keys."""
    svc, *policies = rendered[f"{name}.yaml"]
    for p in policies:
        kubernetes_validate.validate(p, K8S_VERSION, strict=True)
    by_name = {p["metadata"]["name"].removeprefix(f"rayattn-{name}-"): p["spec"]
               for p in policies if p["kind"] == "NetworkPolicy"}
    assert set(by_name) == {"ray-internal", "openai", "ray-operator", "metrics"}
    rc = svc["spec"]["rayClusterConfig"]
    head_t = rc["headGroupSpec"]["template"]
    worker_t = rc["workerGroupSpecs"][0]["template"]
    instance = head_t["metadata"]["labels"]["app.kubernetes.io/instance"]
    assert worker_t["metadata"]["labels"]["app.kubernetes.io/instance"] == instance
    # Every pod is selected (so default-deny applies), and only these ports open wider:
    for spec in by_name.values():
        assert spec["policyTypes"] == ["Ingress"]
        assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == instance
    open_ports = {(k, port["port"]) for k, s in by_name.items() for rule in s["ingress"]
                  for port in rule.get("ports", [])}
    assert open_ports == {("openai", 8000), ("ray-operator", 8265), ("metrics", 8080)}
    assert by_name["ray-operator"]["ingress"][0]["from"][0]["podSelector"] == {
        "matchLabels": {"app.kubernetes.io/component": "kuberay-operator"}}
    assert yaml.safe_load(svc["spec"]["serveConfigV2"])["proxy_location"] == "HeadOnly"
    internal = by_name["ray-internal"]["ingress"][0]
    assert "ports" not in internal and internal["from"] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/instance": instance}}}]
    assert rc["authOptions"] == {"mode": "token"}
    head_ports = {p["containerPort"] for p in head_t["spec"]["containers"][0]["ports"]}
    assert 10001 not in head_ports  # no Ray Client
    # API keys only in the head, where the routers are pinned.
    head_env = {e["name"] for e in head_t["spec"]["containers"][0]["env"]}
    worker_env = {e["name"] for e in worker_t["spec"]["containers"][0]["env"]}
    assert {"RAYATTN_API_KEYS", "RAYATTN_ADMIN_KEYS"} <= head_env
    assert not {"RAYATTN_API_KEYS", "RAYATTN_ADMIN_KEYS"} & worker_env
    resource = json.loads(rc["headGroupSpec"]["rayStartParams"]["resources"])
    assert "resources" not in rc["workerGroupSpecs"][0]["rayStartParams"] or not set(
        resource) & set(json.loads(rc["workerGroupSpecs"][0]["rayStartParams"]["resources"]))
    (_, cfg), = rayattn_apps(yaml.safe_load(svc["spec"]["serveConfigV2"]))
    assert cfg.serve.router_node_resource in resource


def test_routers_need_the_node_resource_engines_do_not(rendered):
    from rayattn.app import engine_options, router_options

    svc = rendered["llama.yaml"][0]
    (_, cfg), = rayattn_apps(yaml.safe_load(svc["spec"]["serveConfigV2"]))
    resource = cfg.serve.router_node_resource
    assert resource and router_options(cfg)["ray_actor_options"]["resources"] == {
        resource: pytest.approx(0.001)}
    engine = engine_options(build_plan(cfg))["ray_actor_options"]
    assert resource not in (engine.get("resources") or {})
    # Without the setting (serve run on one machine) routers go anywhere.
    cfg.serve.router_node_resource = None
    assert "resources" not in router_options(cfg)["ray_actor_options"]


def _two_models() -> dict:
    """llama.yaml's application serving Llama and Qwen3 side by side."""
    sc = yaml.safe_load((ROOT / "deployments" / "llama.yaml").read_text())
    qwen = yaml.safe_load((ROOT / "deployments" / "qwen3.yaml").read_text())
    app = sc["applications"][0]
    args = app["args"]
    qargs = qwen["applications"][0]["args"]
    args["models"] = [{"model": args.pop("model")},
                      {"model": qargs["model"], "attention": qargs.get("attention", {}),
                       "parallelism": qargs.get("parallelism", {})}]
    app["deployments"] = [d for d in app.get("deployments") or [] if d["name"] != "engine"]
    app["deployments"] += [{"name": "engine-llama-3.3-70b", "num_replicas": 2},
                           {"name": "engine-qwen3-235b", "num_replicas": 1}]
    return sc


def test_each_model_of_a_multi_model_app_gets_its_own_worker_group():
    from rayattn.k8s.render import render_rayservice

    svc = render_rayservice(_two_models(), "two")
    groups = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    declared = {g["groupName"]: json.loads(g["rayStartParams"]["resources"]) for g in groups}
    assert len(groups) == 2, declared
    by_resource = {next(k for k in r if k.startswith("rayattn_engine_")): g
                   for g, r in declared.items()}
    assert set(by_resource) == {"rayattn_engine_llama_3_3_70b", "rayattn_engine_qwen3_235b"}
    # The pods' Serve config sends each model's engines to its own group only.
    for name, cfg in rayattn_apps(yaml.safe_load(svc["spec"]["serveConfigV2"])):
        resource = cfg.serve.engine_node_resource
        assert resource in by_resource and resource in build_plan(cfg).bundles[0], name
    # Each group is sized for its own model's replicas (2 of Llama, 1 of Qwen3).
    from rayattn.k8s.render import worker_nodes

    nodes = {g["groupName"]: g["minReplicas"] for g in groups}
    plans = {n: build_plan(c) for n, c in rayattn_apps(_two_models())}
    for model, replicas in (("llama-3.3-70b", 2), ("qwen3-235b", 1)):
        group = by_resource["rayattn_engine_" + model.replace("-", "_").replace(".", "_")]
        assert nodes[group] == worker_nodes(plans[f"rayattn/{model}"], replicas) >= 1


@needs_crds
def test_a_multi_model_rayservice_is_valid_against_kuberay_crds():
    from rayattn.k8s.render import render_rayservice

    svc = render_rayservice(_two_models(), "two")
    jsonschema.validate(svc, crd_schema("ray.io_rayservices.yaml"))
