"""Serve's autoscaling policy for the router tier: as many routers as the routers' CPU asks
for at `target_cpu` cores each. Serve's controller runs it (every router reports its CPU
through `record_autoscaling_stats`, rayattn/server/cpu_meter.py) and applies the tier's
bounds and delays around it (rayattn/config/router_tier.py).

Serve pickles this module by value into its controller: it imports nothing of rayattn."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

METRIC = "router_cpu"
"""Cores a router's process used, averaged over Serve's look-back window."""


def routers_for(cpu: Iterable[float], target_cpu: float, current: int) -> int:
    """Routers that carry the routers' summed CPU at `target_cpu` cores each; `current`
    where none reported yet."""
    cpu = list(cpu)
    if not cpu:
        return current
    return max(1, math.ceil(sum(cpu) / target_cpu - 1e-9))


class RoutersForCpu:
    """The policy Serve instantiates once per deployment (policy_kwargs) and calls with
    its AutoscalingContext on every tick."""

    def __init__(self, target_cpu: float) -> None:
        self.target_cpu = target_cpu

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        per_replica = (ctx.aggregated_metrics or {}).get(METRIC) or {}
        return routers_for(per_replica.values(), self.target_cpu,
                           ctx.target_num_replicas), {}
