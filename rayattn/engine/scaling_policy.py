"""Serve's autoscaling policy for the engine replicas: as many engines as the most pressed of
the user's targets asks for (serve.engine_autoscaling: requests in flight per engine, and
where set the time to first token, the inter-token latency and the KV cache usage).

Each target gives a pressure, what the engines report over what the target allows (1.0: on
target). Above 1 the fleet grows in proportion to the highest pressure, as Serve's own rule
does for requests in flight. Below `hold_band` of every target it shrinks, but only to as
many engines as keep the highest pressure at `hold_band` afterwards, so the next decision
does not grow it again (no flapping); in between it holds. Serve's controller runs it every
tick and applies the bounds and the upscale/downscale delays around it. The engines report
their signals through `record_autoscaling_stats` (rayattn/engine/load_signals.py); a latency
with no request behind it is absent (no traffic, no latency pressure): an idle fleet shrinks
on its requests in flight alone.

Serve pickles this module by value into its controller: it imports nothing of rayattn."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

SIGNALS = ("ttft_p90_s", "itl_p90_s", "kv_usage")
"""The metrics engines report, each named as the target that bounds it."""
ONGOING = "ongoing_requests"
"""The pressure of requests in flight per engine (Serve's own count)."""


def engines_for(current: int, pressures: Mapping[str, float], hold_band: float) -> int:
    """Engines for the highest of `pressures` (observed / target); `current` with none."""
    if current <= 0 or not pressures:
        return current
    top = max(pressures.values())
    if top > 1.0:
        return max(current + 1, math.ceil(current * top - 1e-9))
    if top >= hold_band:
        return current
    return max(1, math.ceil(current * top / hold_band - 1e-9))


def fleet_signal(per_replica: Mapping[Any, float | None] | None) -> float | None:
    """One figure for the fleet from each replica's: their mean, over the replicas that
    reported one (None where none did)."""
    values = [v for v in (per_replica or {}).values() if v is not None]
    return sum(values) / len(values) if values else None


class EnginesForTargets:
    """The policy Serve instantiates once per deployment (policy_kwargs: the targets) and
    calls with its AutoscalingContext on every tick."""

    def __init__(self, hold_band: float = 0.6, ttft_p90_s: float | None = None,
                 itl_p90_s: float | None = None, kv_usage: float | None = None) -> None:
        self.hold_band = hold_band
        self.targets = {k: v for k, v in (("ttft_p90_s", ttft_p90_s),
                                          ("itl_p90_s", itl_p90_s),
                                          ("kv_usage", kv_usage)) if v is not None}

    def pressures(self, ctx: AutoscalingContext) -> dict[str, float]:
        current = ctx.current_num_replicas
        out: dict[str, float] = {}
        if current > 0:
            ongoing = ctx.total_num_requests
            ongoing = ongoing() if callable(ongoing) else ongoing
            out[ONGOING] = ongoing / (ctx.config.get_target_ongoing_requests() * current)
        metrics = ctx.aggregated_metrics or {}
        for name, target in self.targets.items():
            value = fleet_signal(metrics.get(name))
            if value is not None:
                out[name] = value / target
        return out

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        pressures = self.pressures(ctx)
        # Serve keeps the returned state with the deployment: the last decision's reasons.
        return (engines_for(ctx.current_num_replicas, pressures, self.hold_band),
                {"pressures": {k: round(v, 3) for k, v in pressures.items()}})
