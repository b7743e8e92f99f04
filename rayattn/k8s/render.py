"""Render a KubeRay RayService for AMD Instinct clusters from a rayattn Serve config.

The RayService's serveConfigV2 is the very Serve config `serve run` takes (HTTP bound to
0.0.0.0 inside the pod), and the cluster is sized from the same plan `rayattn check` prints:
GPUs per replica (TP×PP), replicas (DP), GPUs per node, backend env.

What the cluster exposes (docs/security.md): NetworkPolicies let other pods reach only the
OpenAI port (guarded by the API keys); the Ray dashboard / job API only from the KubeRay
operator, metrics only from Prometheus's namespace, everything else only from the cluster's
own pods; Ray's token authentication guards GCS and the dashboard besides. The API keys
are only in the head pod, where the routers are pinned; engine pods run model code
(`trust_remote_code`) and hold no key.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from pathlib import Path
from typing import Any

import yaml

from rayattn.cluster_env import cluster_env
from rayattn.config.loader import app_args, load_serve_config, parse_models, rayattn_apps
from rayattn.config.plan import HOST_RESERVE_GIB_PER_GPU, Plan, build_plan
from rayattn.config.schema import RayAttnConfig

RAY_VERSION = "2.60.0"
DEFAULT_IMAGE = "ghcr.io/rayattn/rayattn-rocm:0.1.0"
"""Built from k8s/Dockerfile: AMD's ROCm vLLM image + ray[serve]==2.60.0 + rayattn."""
METRICS_PORT = 8080
MODEL_CACHE = "/models"
# Node labels set by AMD's GPU operator (node-labeller) per Instinct model.
PRODUCT_LABEL = "amd.com/gpu.product-name"
PRODUCTS = {"MI300X": "AMD_Instinct_MI300X_OAM", "MI325X": "AMD_Instinct_MI325X_OAM",
            "MI355X": "AMD_Instinct_MI355X_OAM"}
SHM_GIB = {"MI300X": 64, "MI325X": 64, "MI355X": 128}


def worker_nodes(plan: Plan, replicas: int) -> int:
    per_node = plan.config.platform.gpus_per_node
    replicas_per_node = max(1, per_node // max(1, plan.gpus_per_replica))
    return math.ceil(replicas / replicas_per_node)


def node_range(plans: list[Plan]) -> tuple[int, int]:
    """Fewest and most GPU worker nodes the engine replicas need (autoscaled or fixed, plus
    a rolling update's surge)."""
    def most(p: Plan) -> int:  # a rolling update's surge replicas need devices too
        hi = p.replica_range[1]
        return hi + math.ceil(hi * p.config.serve.engine_max_surge_percent / 100)

    return (sum(worker_nodes(p, p.replica_range[0]) for p in plans),
            sum(worker_nodes(p, most(p)) for p in plans))


API_KEYS_SECRET = "rayattn-api-keys"
ROUTER_RESOURCE = "rayattn_router"
ENGINE_RESOURCE_PREFIX = "rayattn_engine_"


def engine_resource(model: str) -> str:
    """The custom resource of one model's worker group (several models in one app)."""
    return ENGINE_RESOURCE_PREFIX + "".join(c if c.isalnum() else "_" for c in model.lower())
"""Declared by the head alone; the routers need it (serve.router_node_resource)."""
SERVE_PORT = 8000
DASHBOARD_PORT = 8265


def _env(plan: Plan, api_keys: bool) -> list[dict[str, Any]]:
    # Every node: each starts Ray processes that read Serve's ingress flags (front_door.py)
    # and Ray's worker niceness (cpu_priority.py).
    # The plan's env last: an operator's own choice (engine.env) wins.
    ray_env = cluster_env(plan.config.router.session_header)
    env = [{"name": k, "value": v} for k, v in sorted({**ray_env, **plan.env}.items())]
    env += [
        # Never inline the token: read it from a Secret the operator creates. Engines load
        # weights with it, routers the tokenizer.
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": "hf-token", "key": "token", "optional": True}}},
        {"name": "HF_HOME", "value": MODEL_CACHE},
    ]
    if api_keys:
        # The router's API keys (router.api_keys_env / admin_keys_env name these
        # variables). Optional here so the pod starts; a router that needs a missing key
        # refuses to deploy rather than serving openly.
        env += [{"name": var, "valueFrom": {"secretKeyRef": {
            "name": API_KEYS_SECRET, "key": key, "optional": True}}}
            for var, key in (("RAYATTN_API_KEYS", "api-keys"),
                             ("RAYATTN_ADMIN_KEYS", "admin-keys"))]
    return env


def _container(name: str, image: str, plan: Plan, resources: dict, ports: list[dict],
               gpu: bool) -> dict:
    c: dict[str, Any] = {
        "name": name, "image": image, "imagePullPolicy": "IfNotPresent",
        "env": _env(plan, api_keys=not gpu), "resources": resources, "ports": ports,
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                         {"name": "model-cache", "mountPath": MODEL_CACHE}],
        "lifecycle": {"preStop": {"exec": {"command": ["/bin/sh", "-c", "ray stop"]}}},
    }
    if gpu:
        # RCCL and AITER need ptrace-style IPC between the GPU processes of one engine.
        c["securityContext"] = {"capabilities": {"add": ["SYS_PTRACE", "IPC_LOCK"]},
                                "seccompProfile": {"type": "Unconfined"}}
    return c


def _volumes(shm_gib: int) -> list[dict]:
    return [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm_gib}Gi"}},
            {"name": "model-cache", "persistentVolumeClaim": {"claimName": "rayattn-models"}}]


def serve_config_for_pod(serve_config: dict) -> dict:
    """The Serve config as the pods run it: HTTP on every interface of the head, and only
    there, routers pinned to the head (the one pod with the API keys)."""
    sc = copy.deepcopy(serve_config)
    sc["http_options"] = {**sc.get("http_options", {}), "host": "0.0.0.0", "port": SERVE_PORT}
    # HTTP only where the NetworkPolicies open it and the routers run.
    sc["proxy_location"] = "HeadOnly"
    for app in sc.get("applications", []):
        if str(app.get("import_path", "")).startswith("rayattn."):
            args = app.setdefault("args", {})
            args.setdefault("serve", {})["router_node_resource"] = ROUTER_RESOURCE
            if "models" in args:
                # Each model's engines on its own worker group.
                for entry, cfg in zip(args["models"], parse_models(app_args(app)),
                                      strict=True):
                    entry.setdefault("serve", {})["engine_node_resource"] = \
                        engine_resource(cfg.model.name)
    return sc


def worker_memory_gib(plans: list[Plan]) -> tuple[int, int]:
    """A GPU worker pod's memory request and limit: the engine processes' share per GPU plus
    every engine's pinned KV offload tier (engine.kv_offload.size_gib), at least 1 TiB
    requested (model loading stages weights through host memory), and the node's
    platform.host_memory_gib as the limit."""
    plat = plans[0].config.platform
    # Each DP rank inside an engine keeps a host tier of its own.
    offload = max(p.engines_per_node * p.config.parallelism.dp_ranks
                  * p.config.engine.kv_offload.size_gib
                  if p.config.engine.kv_offload.backend == "native" else 0.0 for p in plans)
    need = HOST_RESERVE_GIB_PER_GPU * plat.gpus_per_node + math.ceil(offload)
    limit = plat.host_memory_gib
    return min(max(1024, need), limit), limit


def _worker_group(resource: str | None, plans: list[Plan], image: str,
                  labels: dict[str, str]) -> dict:
    """A GPU worker group for `plans`' engines; `resource`: the custom resource its nodes
    declare, which one model's engines need (serve.engine_node_resource)."""
    plan = plans[0]
    plat = plan.config.platform
    per_node = plat.gpus_per_node
    acc = plat.accelerator_type or "MI300X"
    min_nodes, max_nodes = node_range(plans)
    mem_request, mem_limit = worker_memory_gib(plans)
    group = f"{acc.lower()}-workers" if resource is None else \
        f"{acc.lower()}-{resource.removeprefix(ENGINE_RESOURCE_PREFIX)}"
    declared = {f"accelerator_type:{acc}": 1, **({resource: 1} if resource else {})}
    return {
        "groupName": group,
        "replicas": min_nodes, "minReplicas": min_nodes, "maxReplicas": max_nodes,
        "numOfHosts": 1,
        "rayStartParams": {"num-gpus": str(per_node),
                           "metrics-export-port": str(METRICS_PORT),
                           "resources": json.dumps(declared)},
        "template": {
            "metadata": {"labels": labels},
            "spec": {
                "containers": [_container("ray-worker", image, plan, {
                    "requests": {"cpu": "96", "memory": f"{mem_request}Gi",
                                 "amd.com/gpu": str(per_node)},
                    "limits": {"cpu": "128", "memory": f"{mem_limit}Gi",
                               "amd.com/gpu": str(per_node)},
                }, [{"containerPort": METRICS_PORT, "name": "metrics"}], gpu=True)],
                "volumes": _volumes(SHM_GIB.get(acc, 64)),
                "nodeSelector": {PRODUCT_LABEL: PRODUCTS.get(acc, acc)},
                "tolerations": [{"key": "amd.com/gpu", "operator": "Exists",
                                 "effect": "NoSchedule"}],
            }},
    }


def render_rayservice(serve_config: dict, name: str, image: str = DEFAULT_IMAGE) -> dict:
    apps, plans = _checked_plans(serve_config)
    min_nodes, max_nodes = node_range(plans)
    # With engine autoscaling, Ray's autoscaler adds a worker node when Serve's new replica
    # cannot be placed and removes one left idle; without it the group is fixed.
    elastic = max_nodes > min_nodes
    labels = _pod_labels(name)
    return {
        "apiVersion": "ray.io/v1", "kind": "RayService",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "rayattn",
                                              "app.kubernetes.io/component": "llm-serving"}},
        "spec": {
            # Zero-downtime upgrades: a new cluster is brought up and traffic switches only
            # once its Serve applications are healthy (model loads take minutes).
            "upgradeStrategy": {"type": "NewCluster"},
            "serviceUnhealthySecondThreshold": 1800,
            "deploymentUnhealthySecondThreshold": 1800,
            "serveConfigV2": yaml.safe_dump(serve_config_for_pod(serve_config),
                                            sort_keys=False),
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION, "enableInTreeAutoscaling": elastic,
                # Ray's token authentication: GCS, the dashboard and the job API refuse
                # callers without the cluster's token (KubeRay creates and shares it).
                "authOptions": {"mode": "token"},
                **({"autoscalerOptions": {
                    # A GPU node that held a drained replica goes after 10 idle minutes
                    # (a new one takes minutes to join and load the model).
                    "idleTimeoutSeconds": 600, "upscalingMode": "Default"}} if elastic else {}),
                "headGroupSpec": _head_group(plans[0], image, labels),
                "workerGroupSpecs": _worker_groups(apps, plans, image, labels)},
        },
    }


def _checked_plans(serve_config: dict) -> tuple[list[tuple[str, RayAttnConfig]], list[Plan]]:
    """The rayattn applications of `serve_config` with their plans, refused where one
    cluster cannot serve them."""
    apps = rayattn_apps(serve_config)
    plans = [build_plan(cfg) for _, cfg in apps]
    if plans[0].config.platform.kind != "rocm":
        raise ValueError("platform.kind: render-k8s targets AMD clusters (rocm)")
    headers = {p.config.router.session_header for p in plans}
    if len(headers) > 1:
        # One HAProxy per cluster hashes one header to pick a router (front_door.py).
        raise ValueError(f"router.session_header: the applications of one cluster must agree "
                         f"(HAProxy picks routers by one header); got {sorted(headers)}")
    return apps, plans


def _head_group(plan: Plan, image: str, labels: dict[str, str]) -> dict:
    # No Ray Client port: it runs arbitrary code, and nothing here uses it.
    head_ports = [{"containerPort": 6379, "name": "gcs-server"},
                  {"containerPort": DASHBOARD_PORT, "name": "dashboard"},
                  {"containerPort": SERVE_PORT, "name": "serve"},
                  {"containerPort": METRICS_PORT, "name": "metrics"}]
    return {
        # The dashboard listens on the pod's interfaces for the KubeRay operator, which
        # submits the Serve config through it; the NetworkPolicies admit only the operator.
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": "0",
                           "metrics-export-port": str(METRICS_PORT),
                           "resources": json.dumps({ROUTER_RESOURCE: 1})},
        "template": {
            "metadata": {"labels": labels},
            "spec": {
                # The head runs the Serve controller, proxy and router: no GPUs.
                "containers": [_container("ray-head", image, plan, {
                    "requests": {"cpu": "8", "memory": "32Gi"},
                    "limits": {"cpu": "16", "memory": "64Gi"}}, head_ports, gpu=False)],
                "volumes": _volumes(8),
            }},
    }


def _worker_groups(apps: list[tuple[str, RayAttnConfig]], plans: list[Plan], image: str,
                   labels: dict[str, str]) -> list[dict]:
    """One worker group per model of a multi-model application (its engines need the
    group's resource), one shared group for the rest."""
    groups: dict[str | None, list[Plan]] = {}
    for (app_name, cfg), p in zip(apps, plans, strict=True):
        groups.setdefault(engine_resource(cfg.model.name) if "/" in app_name else None,
                          []).append(p)
    return [_worker_group(resource, group, image, labels) for resource, group in
            groups.items()]


def _pod_labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "rayattn", "app.kubernetes.io/instance": name}


def network_policies(name: str) -> list[dict]:
    """Who may open a connection to the cluster's pods. Policies add up: a pod selected by
    any of them accepts only what one of them admits."""
    pods = {"matchLabels": {"app.kubernetes.io/instance": name}}
    head = {"matchLabels": {"app.kubernetes.io/instance": name, "ray.io/node-type": "head"}}

    def policy(suffix: str, selector: dict, rule: dict) -> dict:
        return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": {"name": f"{name}-{suffix}",
                             "labels": {"app.kubernetes.io/name": "rayattn"}},
                "spec": {"podSelector": selector, "policyTypes": ["Ingress"],
                         "ingress": [rule]}}

    return [
        # Ray's own traffic (GCS, raylets, object transfer, Serve's calls, KV events)
        # between this cluster's pods only.
        policy("ray-internal", pods, {"from": [{"podSelector": pods}]}),
        # The OpenAI API from anywhere: the router's API keys guard it.
        policy("openai", head, {"ports": [{"port": SERVE_PORT, "protocol": "TCP"}]}),
        # The dashboard / job API only from the KubeRay operator (it deploys the Serve
        # config through it).
        policy("ray-operator", head, {
            # The label both of KubeRay's installs (Helm chart, kustomize) put on it.
            "from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {
                "app.kubernetes.io/component": "kuberay-operator"}}}],
            "ports": [{"port": DASHBOARD_PORT, "protocol": "TCP"}]}),
        # Metrics only from Prometheus's namespace (the PodMonitors of monitoring()).
        policy("metrics", pods, {
            "from": [{"namespaceSelector": {"matchLabels": {
                "kubernetes.io/metadata.name": "prometheus-system"}}}],
            "ports": [{"port": METRICS_PORT, "protocol": "TCP"}]}),
    ]


def rayservice_manifest(serve_config: dict, name: str, image: str = DEFAULT_IMAGE) -> str:
    """The RayService and the NetworkPolicies that go with it, as one file."""
    return dump([render_rayservice(serve_config, name, image), *network_policies(name)])


def monitoring(namespace: str = "default") -> list[dict]:
    """PodMonitors for head and workers (Prometheus Operator), as KubeRay's samples."""
    out = []
    for node_type, job in (("head", "ray-head"), ("worker", "ray-workers")):
        out.append({
            "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
            "metadata": {"name": f"rayattn-{job}", "namespace": "prometheus-system",
                         "labels": {"release": "prometheus"}},
            "spec": {"jobLabel": job,
                     "namespaceSelector": {"matchNames": [namespace]},
                     "selector": {"matchLabels": {"ray.io/node-type": node_type,
                                                  "app.kubernetes.io/name": "rayattn"}},
                     "podMetricsEndpoints": [{"port": "metrics", "relabelings": [{
                         "sourceLabels": ["__meta_kubernetes_pod_label_ray_io_cluster"],
                         "targetLabel": "ray_io_cluster"}]}]}})
    return out


def dashboard_configmap() -> dict:
    from rayattn.metrics.dashboard import dashboard

    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "rayattn-grafana-dashboard", "namespace": "prometheus-system",
                         # Grafana's dashboard sidecar picks up ConfigMaps with this label.
                         "labels": {"grafana_dashboard": "1"}},
            "data": {"rayattn-dashboard.json": json.dumps(dashboard(), indent=2)}}


def prometheus_rule() -> dict:
    from rayattn.metrics.dashboard import alert_rules

    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "rayattn-alerts", "namespace": "prometheus-system",
                         "labels": {"release": "prometheus"}},
            "spec": alert_rules()}


MANIFESTS = {"deepseek": "deployments/deepseek.yaml", "qwen3": "deployments/qwen3.yaml",
             "llama": "deployments/llama.yaml"}


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, s: str) -> yaml.Node:
    # Multi-line strings (serveConfigV2, the dashboard JSON) as readable block literals.
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)


_Dumper.add_representer(str, _str)


def dump(docs: list[dict]) -> str:
    return "---\n".join(yaml.dump(d, Dumper=_Dumper, sort_keys=False) for d in docs)


def render_all(root: Path) -> dict[str, str]:
    """Every file under k8s/ that `python -m rayattn.k8s.render` writes (tests compare)."""
    files = {f"{n}.yaml": rayservice_manifest(load_serve_config(root / p), f"rayattn-{n}")
             for n, p in MANIFESTS.items()}
    files["monitoring.yaml"] = dump(monitoring())
    files["grafana-dashboard.yaml"] = dump([dashboard_configmap()])
    files["prometheus-rules.yaml"] = dump([prometheus_rule()])
    return files


def main(args: argparse.Namespace) -> int:
    name = "rayattn-" + Path(args.config).stem
    text = rayservice_manifest(load_serve_config(args.config), name,
                               args.image or DEFAULT_IMAGE)
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[2]
    for fname, text in render_all(root).items():
        (root / "k8s" / fname).write_text(text)
