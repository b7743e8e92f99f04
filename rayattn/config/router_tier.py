"""How many router replicas a deployment runs: a fixed `serve.ingress_replicas`, else the
bounds of `serve.router_tier`, each unset bound derived from the fleet and the cores the
routers may use. Between the bounds, Serve adds and drains routers on their CPU
(rayattn/server/router_scaling.py).

Why these rules: one router is one Python process, whose event loop renders, tokenizes,
hashes and relays every request on one core. On two GPUs with one engine each, one router
lost to sticky routing and four won (docs/results.md), so the floor is two per routing target
(an engine replica, or each DP rank of one). A router that runs does not share its core with
another, so the ceiling is the cores the engines leave. CPU engines take every core they
are given (their OpenMP threads): a second router there only takes time from them.

What the app's build sees: its `args` and the Ray cluster as it is then. An engine count set
only under the Serve config's `deployments:` (an engine `autoscaling_config` there, as
deployments/llama.yaml has) reaches Serve, not the build, which counts the engines `args`
name (`rayattn check` reads both and may print a higher floor); and nodes that join later
are not spare cores. Set `serve.router_tier.min_replicas` where either matters."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rayattn.config.schema import RayAttnConfig

ROUTERS_PER_TARGET = 2
MAX_ROUTERS = 16
CORES_PER_ROUTER = 1.0


@dataclass(frozen=True)
class RouterBounds:
    """The fewest and the most router replicas."""

    min: int
    max: int

    @property
    def fixed(self) -> bool:
        return self.min == self.max

    def __str__(self) -> str:
        return str(self.min) if self.fixed else f"{self.min}..{self.max}"


def routing_targets(cfgs: list[RayAttnConfig], most: bool = False) -> int:
    """Engine routing targets of every model at the fewest replicas each runs (`most`: at
    the most it may run)."""
    return sum(c.engine_replica_range[most] * c.parallelism.dp_ranks for c in cfgs)


def config_bounds(cfg: RayAttnConfig) -> RouterBounds:
    """The bounds as one model's config alone implies them, cores unknown: what a router
    reads back from the args the app's build resolved."""
    return router_bounds(cfg, routing_targets([cfg]), None)


def router_bounds(cfg: RayAttnConfig, targets: int, spare_cores: float | None) -> RouterBounds:
    """The router tier's bounds for a deployment of `targets` engine routing targets, where
    `spare_cores` CPUs are left once the engines have theirs (None: not known, as in
    `rayattn check` away from the cluster)."""
    serve = cfg.serve
    if serve.ingress_replicas is not None:
        return RouterBounds(serve.ingress_replicas, serve.ingress_replicas)
    tier = serve.router_tier
    if cfg.platform.kind == "cpu":
        lo = tier.min_replicas or 1
        return RouterBounds(lo, max(lo, tier.max_replicas or 1))
    cap = MAX_ROUTERS if spare_cores is None else \
        max(1, min(MAX_ROUTERS, math.floor(spare_cores / CORES_PER_ROUTER)))
    lo = tier.min_replicas or min(max(1, min(ROUTERS_PER_TARGET * targets, cap // 2)),
                                  tier.max_replicas or MAX_ROUTERS)
    return RouterBounds(lo, max(lo, tier.max_replicas or cap))
