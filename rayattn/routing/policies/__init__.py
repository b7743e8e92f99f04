"""The routing policies, registered once: each module declares a `SPEC` (name, the router
settings it reads, a factory), and everything else derives from `REGISTRY`: the names the
config accepts, which live setting changes rebuild a policy, the benchmark's and the
simulator's policy lists. A new policy is one new module and one line here."""

from __future__ import annotations

from collections.abc import Mapping
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
from rayattn.routing.policies.spec import PolicySpec

REGISTRY: dict[str, PolicySpec] = {s.name: s for s in (
    affinity.SPEC, round_robin.SPEC, power_of_two.SPEC, ray_prefix.SPEC, sticky.SPEC)}


def spec(name: str) -> PolicySpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; allowed: "
                         f"{', '.join(REGISTRY)}") from None


def build(name: str, ctx: PolicyContext, settings: Mapping[str, Any]) -> Policy:
    """The one place a policy is built (rayattn/routing/core.py calls it)."""
    return spec(name).factory(ctx, settings)


__all__ = ["REGISTRY", "Decision", "Policy", "PolicyContext", "PolicySpec", "RouteRequest",
           "build", "cached_tokens", "rendezvous_rank", "spec"]
