"""The dashboard's host-tier panels read vLLM's own metrics, which the CPU engine (no KV
offload) never exports: their names are checked here against vLLM's definitions instead of
a live Prometheus (tests/integration/test_metrics.py evaluates every other panel)."""

from __future__ import annotations

import inspect
import re

from rayattn.metrics.dashboard import PANELS, metric_names


def _ray_counter(vllm_name: str) -> str:
    # vLLM's RayPrometheusStatLogger sanitises ':' to '_'; Ray's exporter adds the prefix
    # and, for counters, '_total'.
    return "ray_" + re.sub(r"[^a-zA-Z0-9_]", "_", vllm_name) + "_total"


def router_declared() -> set[str]:
    """The series rayattn's router declares, as Ray exports them."""
    from rayattn.metrics import router_metrics

    return {"ray_" + n for n in
            re.findall(r'"(rayattn_[a-z_]+)"', inspect.getsource(router_metrics))}


def test_host_tier_panels_read_metrics_vllm_defines():
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        get_connector_metric_definitions,
    )
    from vllm.v1.kv_offload.base import OffloadingCounterMetadata
    from vllm.v1.metrics import loggers

    counters = {_ray_counter(n) for n, m in get_connector_metric_definitions().items()
                if isinstance(m, OffloadingCounterMetadata)}
    counters |= {_ray_counter(n) for n in
                 re.findall(r'name="(vllm:[a-z_]+)"', inspect.getsource(loggers))}
    panels = [p for p in PANELS if p.host_tier]
    assert panels
    read = metric_names([e for p in panels for e, _ in p.exprs])
    vllm_read = {n for n in read if n.startswith("ray_vllm_")}
    # offload and reload bytes and time, hits by tier
    assert {"ray_vllm_kv_offload_load_bytes_total", "ray_vllm_kv_offload_store_bytes_total",
            "ray_vllm_external_prefix_cache_hits_total"} <= vllm_read
    assert vllm_read <= counters, vllm_read - counters
    # the router's side of the same panel: series rayattn declares
    declared = router_declared()
    ours = {n for n in read if n.startswith("ray_rayattn_")}
    assert "ray_rayattn_router_predicted_reload_tokens_total" in ours
    assert ours <= declared, ours - declared


def test_fleet_change_panels_read_series_the_router_declares():
    """Warming counts only once engines joined or left a router that lives on, which the
    shared test app's router (replaced by the rolling update) may not have seen: the names
    are checked against rayattn's declarations instead of a live Prometheus."""
    panels = [p for p in PANELS if p.fleet_change]
    assert panels
    read = metric_names([e for p in panels for e, _ in p.exprs])
    assert "ray_rayattn_router_warm_tokens_total" in read
    assert read <= router_declared(), read - router_declared()
