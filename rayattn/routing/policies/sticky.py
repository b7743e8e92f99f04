"""`sticky`: a conversation stays on the replica of its first turn; a new one goes to the
least loaded replica (vllm-router's `sticky_least_loaded`, for comparison on the same
engines and in the simulator). Blind to caches: it keeps histories home, and never moves
one for load."""

from __future__ import annotations

from rayattn.routing.policies.base import Decision, Policy, PolicyContext, RouteRequest
from rayattn.routing.policies.spec import PolicyParams, PolicySpec


class Sticky(Policy):
    name = "sticky"

    def choose(self, req: RouteRequest, replicas: list[str]) -> Decision:
        chosen: str
        if req.previous is not None and req.previous in replicas:
            chosen, reason = req.previous, "session"
        else:
            chosen, reason = min(replicas, key=lambda r: self.load.inflight[r]), "cold"
        return Decision(chosen, reason, self.predicted(req, chosen))


def _build(ctx: PolicyContext, params: PolicyParams) -> Sticky:
    return Sticky(ctx)


SPEC = PolicySpec("sticky", "a conversation stays on its first replica; new ones to the "
                  "least loaded (like vllm-router's sticky_least_loaded)", PolicyParams, _build,
                  uses_prefix_cache=False)
