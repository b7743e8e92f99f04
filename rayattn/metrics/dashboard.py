"""The Grafana dashboard and Prometheus alert rules, generated from one list of queries so
the integration test can evaluate every expression against a real Prometheus.

Ray prefixes exported metric names with `ray_`. Dashboard variables: $model, $replica.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

SEL = 'model=~"$model"'
RSEL = 'model=~"$model", replica=~"$replica"'
VSEL = 'model_name=~"$model"'
"""vLLM's own metrics (RayPrometheusStatLogger) label the served model `model_name`."""


@dataclass(frozen=True)
class Panel:
    title: str
    exprs: tuple[tuple[str, str], ...]
    """(PromQL, legend) pairs."""
    unit: str = "s"
    kind: str = "timeseries"
    host_tier: bool = False
    """Has data only where engines run a host-memory KV tier (engine.kv_offload; vLLM's CPU
    build has none): the CPU test skips it, the GPU bench checks its series."""
    fleet_change: bool = False
    """Has data only once engines joined or left a router that lives on (warming): the
    live test skips it; tests/unit/metrics/test_dashboard.py checks the router declares
    the series it reads."""


def _q(h: str, q: float, by: str, sel: str = RSEL, window: str = "1m") -> str:
    return (f"histogram_quantile({q}, sum by (le, {by}) "
            f"(rate(ray_rayattn_{h}_bucket{{{sel}}}[{window}])))")


PANELS: list[Panel] = [
    Panel("TTFT p50 / p90 by path (prefill vs extend)",
          ((_q("ttft_seconds", 0.5, "path"), "p50 {{path}}"),
           (_q("ttft_seconds", 0.9, "path"), "p90 {{path}}"))),
    Panel("Prompt tokens/s by path: computed vs served from cache",
          ((f"sum by (path, kind) (rate(ray_rayattn_tokens_total{{{RSEL}}}[1m]))",
            "{{path}} {{kind}}"),), unit="short"),
    Panel("Decode inter-token latency p50 / p90",
          ((_q("decode_itl_seconds", 0.5, "replica"), "p50 {{replica}}"),
           (_q("decode_itl_seconds", 0.9, "replica"), "p90 {{replica}}"))),
    Panel("Queue time p90 by path", ((_q("queue_seconds", 0.9, "path"), "{{path}}"),)),
    Panel("Prefix cache hit rate (tokens)",
          ((f'sum(rate(ray_rayattn_tokens_total{{{SEL}, kind="cached"}}[5m])) / '
            f'sum(rate(ray_rayattn_tokens_total{{{SEL}, kind=~"cached|computed"}}[5m]))',
            "hit rate"),), unit="percentunit"),
    Panel("Router: predicted vs actual cached tokens/s",
          ((f"sum(rate(ray_rayattn_router_predicted_cached_tokens_total{{{SEL}}}[5m]))",
            "predicted"),
           (f"sum(rate(ray_rayattn_router_actual_cached_tokens_total{{{SEL}}}[5m]))",
            "actual")), unit="short"),
    Panel("Router drift |actual - predicted| p90 by direction",
          ((_q("router_cached_tokens_drift", 0.9, "direction", SEL, "5m"), "{{direction}}"),),
          unit="short"),
    Panel("Router decisions/s by reason",
          ((f"sum by (policy, reason) (rate(ray_rayattn_router_decisions_total{{{SEL}}}[1m]))",
            "{{policy}} {{reason}}"),), unit="reqps"),
    Panel("Router regret: tokens recomputed that another replica held, by reason",
          ((f"sum by (reason) (rate(ray_rayattn_router_regret_tokens_total{{{SEL}}}[5m]))",
            "{{reason}}"),), unit="short"),
    Panel("Conversations moved off their previous replica/s, by reason",
          ((f"sum by (reason) (rate(ray_rayattn_router_session_moves_total{{{SEL}}}[5m]))",
            "{{reason}}"),), unit="reqps"),
    Panel("Router index: blocks each engine holds, by tier",
          ((f"sum by (target, tier) (ray_rayattn_router_index_blocks{{{SEL}}})",
            "{{target}} {{tier}}"),), unit="short"),
    Panel("Prefix hits by tier (tokens/s): engines (vLLM) vs the router's prediction",
          ((f"sum(rate(ray_vllm_prefix_cache_hits_total{{{VSEL}}}[5m]))", "engine HBM"),
           (f"sum(rate(ray_vllm_external_prefix_cache_hits_total{{{VSEL}}}[5m]))",
            "engine host tier"),
           (f"sum(rate(ray_rayattn_router_predicted_cached_tokens_total{{{SEL}}}[5m])) - "
            f"sum(rate(ray_rayattn_router_predicted_reload_tokens_total{{{SEL}}}[5m]))",
            "router HBM"),
           (f"sum(rate(ray_rayattn_router_predicted_reload_tokens_total{{{SEL}}}[5m]))",
            "router host tier")), unit="short", host_tier=True),
    Panel("Host KV tier: bytes/s offloaded (HBM to host) and reloaded (host to HBM)",
          ((f"sum(rate(ray_vllm_kv_offload_store_bytes_total{{{VSEL}}}[1m]))", "offload"),
           (f"sum(rate(ray_vllm_kv_offload_load_bytes_total{{{VSEL}}}[1m]))", "reload")),
          unit="Bps", host_tier=True),
    Panel("Host KV tier: transfer time per second of wall time",
          ((f"sum(rate(ray_vllm_kv_offload_store_time_total{{{VSEL}}}[1m]))", "offload"),
           (f"sum(rate(ray_vllm_kv_offload_load_time_total{{{VSEL}}}[1m]))", "reload")),
          unit="percentunit", host_tier=True),
    Panel("Cache-pressure admission: each engine's fill (of this router's share), requests "
          "waiting for KV room",
          ((f"min by (target) (ray_rayattn_router_admission_fill{{{SEL}}})", "fill {{target}}"),
           (f"sum(ray_rayattn_router_kv_waiting{{{SEL}}})", "waiting")), unit="short"),
    Panel("In-flight requests per replica",
          ((f'max by (target) (ray_rayattn_router_inflight{{{SEL}}})', "{{target}}"),),
          unit="short"),
    Panel("Engine replicas: Serve runs vs up at the router (autoscaling, updates)",
          ((f"max by (model) (ray_rayattn_router_replicas{{{SEL}}})", "Serve {{model}}"),
           (f"min by (model) (ray_rayattn_router_replicas_up{{{SEL}}})", "up {{model}}")),
          unit="short"),
    # `or vector(0)`: a fleet that never changed draws zero, not an empty panel.
    Panel("Engine warming: tokens/s prefilled on joining engines (join) and for the "
          "conversations of leaving ones (move)",
          ((f"sum by (why) (rate(ray_rayattn_router_warm_tokens_total{{{SEL}}}[5m]))",
            "{{why}}"),
           (f"sum(rate(ray_rayattn_router_warm_tokens_total{{{SEL}}}[5m])) or vector(0)",
            "all")), unit="short", fleet_change=True),
    Panel("KV cache usage (what engine autoscaling's kv_usage target reads)",
          ((f"avg by (model_name) (ray_vllm_kv_cache_usage_perc{{{VSEL}}})",
            "mean {{model_name}}"),
           (f"max by (model_name) (ray_vllm_kv_cache_usage_perc{{{VSEL}}})",
            "busiest {{model_name}}")), unit="percentunit"),
    Panel("Load imbalance (max/mean in-flight)",
          ((f"max(ray_rayattn_router_imbalance{{{SEL}}})", "imbalance"),), unit="short"),
    Panel("Engine steps by batch mix (mixed = decodes slowed by prefill/extend)",
          ((f"sum by (mix) (rate(ray_rayattn_steps_total{{{RSEL}}}[1m]))", "{{mix}}"),),
          unit="short"),
    Panel("Engine step time by batch part",
          ((f"sum by (part) (rate(ray_rayattn_step_seconds_total{{{RSEL}}}[1m]))",
            "{{part}}"),), unit="percentunit"),
    Panel("Replicas: backend, TP, EP",
          ((f"max by (replica, dp_rank, backend, tp, ep, platform) "
            f"(ray_rayattn_engine_info{{{SEL}}})", "{{replica}} {{backend}} TP{{tp}} EP={{ep}}"),),
          unit="short", kind="table"),
    Panel("Router retries and failures/s",
          ((f"sum(rate(ray_rayattn_router_retries_total{{{SEL}}}[5m])) or vector(0)",
            "retries"),
           (f"sum(rate(ray_rayattn_router_failures_total{{{SEL}}}[5m])) or vector(0)",
            "failures")), unit="reqps"),
]


@dataclass(frozen=True)
class Alert:
    name: str
    quantity: str
    """The measured expression (the integration test checks it returns data)."""
    condition: str
    """Appended to `quantity` to make the alert expression."""
    for_: str
    summary: str
    action: str


ALERTS: list[Alert] = [
    Alert("RayattnPrefillTTFTHigh",
          'histogram_quantile(0.9, sum by (le, model) '
          '(rate(ray_rayattn_ttft_seconds_bucket{path="prefill"}[5m])))',
          " > 5", "10m", "Prefill TTFT p90 above 5 s",
          "Prompts queue behind each other: add replicas or lower max_num_batched_tokens."),
    Alert("RayattnExtendTTFTHigh",
          'histogram_quantile(0.9, sum by (le, model) '
          '(rate(ray_rayattn_ttft_seconds_bucket{path="extend"}[5m])))',
          " > 2", "10m", "Extend (cache-hit) TTFT p90 above 2 s",
          "Cache hits are slow: replicas overloaded; check imbalance and load guard."),
    Alert("RayattnCacheHitCollapse",
          'sum by (model) (rate(ray_rayattn_tokens_total{kind="cached"}[15m])) / '
          'sum by (model) (rate(ray_rayattn_tokens_total{kind=~"cached|computed"}[15m]))',
          " < 0.05", "15m", "Prefix cache hit rate under 5%",
          "Replicas restarted or KV cache too small; compare predicted vs actual drift."),
    # The guard lets a replica carry router.load_slack (4) above the mean however small the
    # mean, so at low load twice the mean is by design: alert only past that gap too.
    Alert("RayattnLoadImbalance", "max by (model) (ray_rayattn_router_imbalance)",
          " > 2 and on (model) (max by (model) (ray_rayattn_router_inflight)"
          " - avg by (model) (ray_rayattn_router_inflight)) > 4", "10m",
          "One replica holds twice the mean in-flight load and 4 requests more",
          "Check for a slow replica; else lower router.load_epsilon / router.load_slack."),
    # Against the replicas Serve runs, not a past count: autoscaling and rolling updates
    # remove replicas on purpose.
    Alert("RayattnReplicaDown",
          "max by (model) (ray_rayattn_router_replicas) - "
          "min by (model) (ray_rayattn_router_replicas_up)",
          " > 0", "2m", "An engine replica Serve runs is not serving",
          "Check the Serve controller logs and the engine replica's health check."),
    # Admission holds new conversations while live histories fill the caches: brief waits
    # are the feature; a queue that never drains is a fleet too small for its histories.
    Alert("RayattnKVRoomWait", "sum by (model) (ray_rayattn_router_kv_waiting)",
          " > 0", "10m", "Requests have waited in the router for KV room for 10 minutes",
          "Live conversations' histories fill the engines' KV caches: add engines, a host "
          "KV tier (engine.kv_offload) or fp8 KV (attention.kv_cache_dtype)."),
]


def dashboard() -> dict:
    panels = []
    for i, p in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": p.kind, "title": p.title,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": (i % 2) * 12, "y": (i // 2) * 8},
            "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
            "targets": [{"expr": e, "legendFormat": leg, "refId": chr(65 + j)}
                        for j, (e, leg) in enumerate(p.exprs)],
        })

    def var(name: str, query: str) -> dict:
        return {"name": name, "type": "query", "includeAll": True, "multi": True,
                "allValue": ".*", "current": {"text": "All", "value": "$__all"},
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "query": {"query": query, "refId": name}, "refresh": 2}

    return {
        "title": "rayattn: attention paths, cache affinity, load", "uid": "rayattn",
        "schemaVersion": 39, "tags": ["rayattn", "vllm", "ray"], "time": {"from": "now-1h",
                                                                        "to": "now"},
        "refresh": "30s", "panels": panels,
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus"},
            var("model", "label_values(ray_rayattn_engine_info, model)"),
            var("replica", 'label_values(ray_rayattn_engine_info{model=~"$model"}, replica)'),
        ]},
    }


def alert_rules() -> dict:
    return {"groups": [{"name": "rayattn", "rules": [
        {"alert": a.name, "expr": a.quantity + a.condition, "for": a.for_,
         "labels": {"severity": "warning"},
         "annotations": {"summary": a.summary, "runbook": a.action}} for a in ALERTS]}]}


def all_queries(host_tier: bool = True, fleet_change: bool = True) -> list[str]:
    """Every dashboard expression plus every alert quantity (for tests); without the
    host-tier panels' when `host_tier` is False, without the fleet-change panels' when
    `fleet_change` is False."""
    return [e for p in PANELS if (host_tier or not p.host_tier)
            and (fleet_change or not p.fleet_change) for e, _ in p.exprs] + \
        [a.quantity for a in ALERTS]


def metric_names(exprs: list[str]) -> set[str]:
    """The series names the expressions read (histograms by their base name)."""
    names = set(re.findall(r"\b(ray_[a-z0-9_]+)\{", " ".join(exprs)))
    return {re.sub(r"_bucket$", "", n) for n in names}


def write(out_dir: str | Path) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rayattn-dashboard.json").write_text(json.dumps(dashboard(), indent=2) + "\n")
    (out / "rayattn-alerts.yaml").write_text(yaml.safe_dump(alert_rules(), sort_keys=False))


if __name__ == "__main__":
    write(Path(__file__).resolve().parents[2] / "dashboards")
