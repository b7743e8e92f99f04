"""Serve's autoscaling policy for the router tier: as many routers as the routers' CPU asks
for at `target_cpu` cores each. Serve's controller runs it (every router reports its CPU
through `record_autoscaling_stats`, rayattn/server/cpu_meter.py) and applies the tier's
bounds and delays around it (rayattn/config/router_tier.py).

Serve pickles this module by value into its controller: it imports nothing of rayattn."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

METRIC = "router_cpu"
"""Cores a router's process used, averaged over Serve's look-back window."""


def routers_for(cpu: Iterable[float], target_cpu: float, current: int) -> int:
    """Routers that carry the routers' CPU at `target_cpu` cores each; `current` where none
    reported yet. The CPU is the reports' mean times the routers running: a router that has
    not reported yet (just started) carries its share too."""
    cpu = list(cpu)
    if not cpu:
        return current
    total = sum(cpu) / len(cpu) * max(len(cpu), current)
    return max(1, math.ceil(total / target_cpu - 1e-9))


class RoutersForCpu:
    """The policy Serve instantiates once per deployment (policy_kwargs) and calls with
    its AutoscalingContext on every tick."""

    def __init__(self, target_cpu: float) -> None:
        self.target_cpu = target_cpu

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        per_replica = (ctx.aggregated_metrics or {}).get(METRIC) or {}
        return routers_for(per_replica.values(), self.target_cpu,
                           ctx.current_num_replicas), {}
