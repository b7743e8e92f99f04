"""`power_of_two`: the less loaded of two random replicas (load only, no cache)."""

from __future__ import annotations

import random

from rayattn.routing.policies.base import Decision, Policy, PolicyContext, RouteRequest
from rayattn.routing.policies.spec import PolicyParams, PolicySpec


class PowerOfTwo(Policy):
    name = "power_of_two"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._rng = random.Random(ctx.seed)

    def choose(self, req: RouteRequest, replicas: list[str]) -> Decision:
        pair = self._rng.sample(replicas, min(2, len(replicas)))
        r = min(pair, key=lambda x: self.load.inflight[x])
        return Decision(r, "power_of_two", self.predicted(req, r))


def _build(ctx: PolicyContext, params: PolicyParams) -> PowerOfTwo:
    return PowerOfTwo(ctx)


SPEC = PolicySpec("power_of_two", "the less loaded of two random replicas", PolicyParams,
                  _build, uses_prefix_cache=False)
