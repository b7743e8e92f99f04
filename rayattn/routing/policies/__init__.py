"""The routing policies, registered once: each module declares a `SPEC` (name, its typed
parameters, a factory), and everything else derives from `REGISTRY`: the names the config
accepts, which live setting changes rebuild a policy, the benchmark's and the simulator's
policy lists. A new policy is one new module and one line here (and, if it has parameters,
its field group and params in rayattn/routing/settings.py, which checks that at import)."""

from __future__ import annotations

from typing import Any

from rayattn.routing.policies import affinity, power_of_two, ray_prefix, round_robin, sticky
from rayattn.routing.policies.base import (
    Decision,
    Policy,
    PolicyContext,
    RouteRequest,
    cached_tokens,
    rendezvous_rank,
)
from rayattn.routing.policies.spec import PolicyParams, PolicySpec

REGISTRY: dict[str, PolicySpec[Any]] = {s.name: s for s in (
    affinity.SPEC, round_robin.SPEC, power_of_two.SPEC, ray_prefix.SPEC, sticky.SPEC)}


def spec(name: str) -> PolicySpec[Any]:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; allowed: "
                         f"{', '.join(REGISTRY)}") from None


def build(name: str, ctx: PolicyContext, params: PolicyParams) -> Policy:
    """The one place a policy is built (rayattn/routing/core.py calls it, with
    `RoutingSettings.params(name)`)."""
    s = spec(name)
    if type(params) is not s.params:  # every params class is a PolicyParams: exactly it
        raise TypeError(f"policy {s.name} is built from {s.params.__name__}, "
                        f"not {type(params).__name__}")
    return s.factory(ctx, params)


__all__ = ["REGISTRY", "Decision", "Policy", "PolicyContext", "PolicyParams", "PolicySpec",
           "RouteRequest", "build", "cached_tokens", "rendezvous_rank", "spec"]
