"""`ray_prefix`: Ray Serve LLM's PrefixCacheAffinityRouter, reproduced for comparison."""

from __future__ import annotations

from pydantic import BaseModel, Field

from rayattn.routing.policies.base import Decision, PolicyContext, RouteRequest
from rayattn.routing.policies.power_of_two import PowerOfTwo
from rayattn.routing.policies.spec import PolicyParams, PolicySpec
from rayattn.routing.text_tree import TextPrefixTree


class RayPrefixFields(BaseModel):
    """`ray_prefix`'s parameters, as `router:` spells them (RouterConfig takes these fields;
    prefixed there, as every router setting shares one namespace)."""

    ray_prefix_match_rate_threshold: float = Field(0.1, ge=0, le=1)
    """`ray_prefix` policy: minimum matched fraction before affinity is used (Ray's default)."""
    ray_prefix_imbalanced_threshold: int = Field(10, ge=0)
    """`ray_prefix` policy: max-min queue gap beyond which it falls back to power-of-two."""


class RayPrefixParams(RayPrefixFields, PolicyParams):
    """`ray_prefix`'s parameters, frozen (its factory's input)."""


class RayPrefix(PowerOfTwo):
    """Ray Serve LLM's PrefixCacheAffinityRouter, reproduced for comparison on the same
    engines: a character prefix tree over the prompt text (no chat template), affinity only
    when the match rate passes a threshold and the fleet is balanced within an absolute
    gap, else power-of-two; prompt text inserted at routing, responses never."""

    name = "ray_prefix"

    def __init__(self, ctx: PolicyContext, match_rate_threshold: float = 0.1,
                 imbalanced_threshold: int = 10) -> None:
        super().__init__(ctx)
        self.tree = TextPrefixTree()
        self.match_rate_threshold = match_rate_threshold
        self.imbalanced_threshold = imbalanced_threshold

    def choose(self, req: RouteRequest, replicas: list[str]) -> Decision:
        loads = [self.load.inflight[r] for r in replicas]
        if max(loads) - min(loads) <= self.imbalanced_threshold and req.text:
            matched, owners = self.tree.longest_match(req.text, set(replicas))
            if owners and matched / len(req.text) >= self.match_rate_threshold:
                r = min(owners, key=lambda x: self.load.inflight[x])
                return Decision(r, "affinity_hit", self.predicted(req, r))
        d = super().choose(req, replicas)
        d.reason = "power_of_two"
        return d

    def on_dispatch(self, replica: str, req: RouteRequest) -> None:
        if req.text:
            self.tree.insert(req.text, replica)

    def forget_replica(self, replica: str) -> None:
        self.tree.remove_tenant(replica)


def _build(ctx: PolicyContext, params: RayPrefixParams) -> RayPrefix:
    return RayPrefix(ctx, params.ray_prefix_match_rate_threshold,
                     params.ray_prefix_imbalanced_threshold)


SPEC = PolicySpec("ray_prefix", "a text prefix tree like Ray Serve LLM's "
                  "PrefixCacheAffinityRouter (for comparison)", RayPrefixParams, _build)
