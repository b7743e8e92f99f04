"""`round_robin`: each request to the next replica in turn, blind to caches and load."""

from __future__ import annotations

from rayattn.routing.policies.base import Decision, Policy, PolicyContext, RouteRequest
from rayattn.routing.policies.spec import PolicyParams, PolicySpec


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._next = 0

    def choose(self, req: RouteRequest, replicas: list[str]) -> Decision:
        r = replicas[self._next % len(replicas)]
        self._next += 1
        return Decision(r, "round_robin", self.predicted(req, r))


def _build(ctx: PolicyContext, params: PolicyParams) -> RoundRobin:
    return RoundRobin(ctx)


SPEC = PolicySpec("round_robin", "each request to the next replica in turn", PolicyParams,
                  _build, uses_prefix_cache=False)
