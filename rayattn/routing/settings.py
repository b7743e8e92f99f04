"""The routing core's settings, typed and frozen, and where each is declared.

Every routing setting is declared once, with its default, bounds and doc string: the core's
own in `CoreFields` here, each policy's in its module's field group (`AffinityFields`, ...).
From those declarations:

- `RouterFields` is every routing setting as `router:` spells it, flat: RouterConfig (the
  user-facing schema, rayattn/config/schema.py) takes these fields as they are, so YAML
  configs name them as they always did.
- `RoutingSettings` is what the routing core holds: the core's fields plus one frozen params
  object per policy that has parameters, derived from a RouterConfig by `RoutingSettings.of`
  (the one place). A change of settings is a new object (`replace`, or `of` again).
"""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rayattn.routing import policies
from rayattn.routing.policies.affinity import AffinityFields, AffinityParams
from rayattn.routing.policies.ray_prefix import RayPrefixFields, RayPrefixParams
from rayattn.routing.policies.spec import PolicyParams

IndexMode = Literal["events", "predicted"]
KVAdmissionProtect = Literal["auto", "live", "running"]


class CoreFields(BaseModel):
    """The routing core's own settings (its policies' parameters aside), as `router:`
    spells them."""

    index: IndexMode = "events"
    """Where the router's picture of each engine's cache comes from. `events`: the engines'
    own KV events (BlockStored / BlockRemoved / AllBlocksCleared), shared truth for every
    router replica, with the router's routing decisions kept only as a short-lived
    speculative overlay until the engine's event arrives. `predicted`: the router's own
    decisions, an LRU bounded by each engine's KV capacity (a guess, private to each
    router replica); for engines that cannot publish events."""
    speculative_ttl_s: float = Field(30.0, gt=0)
    """`events` index: how long a block the router sent somewhere counts as cached there
    without the engine's event confirming it (covers queueing before prefill)."""
    policy: str = "affinity"
    """How the ingress picks an engine replica: one of the policies registered in
    rayattn/routing/policies/ (`affinity`: predicted-TTFT cost over the engines' cached
    blocks; `round_robin`; `power_of_two`: least in-flight of two random; for comparison,
    `sticky`: vllm-router's sticky_least_loaded, and `ray_prefix`: a text prefix tree like
    Ray Serve LLM's PrefixCacheAffinityRouter)."""
    kv_admission: bool | Literal["auto"] = "auto"
    """Cache-pressure-aware admission: a request waits in the router while its engine's
    running requests plus the histories of its live conversations (by `session_header`)
    would overflow the engine's KV cache, continuing conversations before new ones, so a
    burst of new conversations cannot evict the histories of those in their think time
    (routing/kv_budget.py). Without a host KV tier, LRU eviction otherwise makes every
    turn a full prefill once the live histories outgrow HBM. With one (engine.kv_offload),
    quiet histories survive in host memory: only the histories of turns in flight are
    protected, and admission mostly runs continuing turns first. `auto`: each engine starts
    at its ceiling (`kv_admission_fill` unset: the first conversations are admitted before
    any comes back to show how its history grew) and, while its live conversations come
    back to find their histories kept (the engine's own KV events say), climbs past it up
    to the whole cache; a lost history brings it back under the ceiling. A set
    `kv_admission_fill`, or `true`, keeps the ceiling a cap. `false`: every request goes
    straight to its engine. Each router replica budgets its share of every engine's cache;
    a request bigger than that budget by itself does not wait."""
    conversation_idle_s: float | None = Field(None, gt=0)
    """`kv_admission`: how long after its last turn a conversation still counts as live
    (its history kept free of eviction). None: twice the 90th percentile of the pauses
    seen between conversations' turns (the clients' think time, learned; 5 s until 16 are
    seen), within 1–60 s. Longer protects slower conversations and holds new ones back
    longer."""
    kv_admission_fill: float | None = Field(None, gt=0, le=1)
    """`kv_admission`: the most of each engine's KV cache (of this router's share of it)
    that running requests and protected histories may fill (the rest is headroom for what
    the router cannot see: output beyond max_tokens estimates, histories growing turn by
    turn). None: 0.7 on engines without a host tier (newcomers admitted on today's
    histories keep growing histories in HBM), 0.95 on engines with one (engine.kv_offload:
    a history pushed out of HBM is reloaded, not recomputed); docs/results.md has the runs
    that chose both; with `kv_admission: auto`, unset is where each engine's fill starts
    and it climbs on to the whole cache while histories are kept. Each engine's fill backs
    off from the ceiling while its live conversations come back to find their history
    evicted, and climbs back while they find it kept (routing/kv_budget.py; /health's
    `admission_fill`)."""
    kv_admission_protect: KVAdmissionProtect = "auto"
    """`kv_admission`: whose histories a newcomer may not push out of HBM. `live`: every
    live conversation's (continuing turns never queue behind new conversations' prefills;
    new conversations wait until live ones go quiet). `running`: only those with a turn in
    flight, every prompt counted whole (quiet histories wait in the engine's host KV tier;
    admission then mostly runs continuing turns first). `auto`: `running` on engines with
    a host tier (engine.kv_offload), else `live` (docs/results.md measures both)."""
    dp_rank_routing: bool = True
    """Engines that run DP ranks inside themselves (parallelism.dp_attention or
    engine_dp_size): route to each rank as a target of its own, by its own KV events and
    load, and tell vLLM which rank runs the request. False routes to the engine replica
    and leaves the rank to vLLM's internal balancer, which weighs queue lengths, not
    cached prefixes."""

    @field_validator("policy")
    @classmethod
    def _registered(cls, name: str) -> str:
        return policies.spec(name).name  # ValueError naming the registered ones


# Bases listed last-first: pydantic takes inherited fields in reverse MRO order, and the
# core's own come first in `router:` as before.
class RouterFields(RayPrefixFields, AffinityFields, CoreFields):
    """Every routing setting, flat, as `router:` spells it (RouterConfig's base)."""


class RoutingSettings(CoreFields):
    """What the routing core runs on (rayattn/routing/core.py): frozen, so a change of
    settings is a new object the core compares with the one it had."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    affinity: AffinityParams = Field(default_factory=AffinityParams)
    """`affinity`'s parameters."""
    ray_prefix: RayPrefixParams = Field(default_factory=RayPrefixParams)
    """`ray_prefix`'s parameters."""

    @classmethod
    def of(cls, source: RouterFields) -> RoutingSettings:
        """The settings a router config (or any RouterFields) declares: the one place the
        flat `router:` fields become the core's typed settings."""
        core = {name: getattr(source, name) for name in CoreFields.model_fields}
        params = {s.name: s.params.of(source) for s in policies.REGISTRY.values()
                  if s.name in cls.model_fields}
        return cls(**core, **params)

    def params(self, policy: str) -> PolicyParams:
        """The parameters of `policy` (its own params class; an empty PolicyParams for a
        policy that reads none)."""
        spec = policies.spec(policy)
        if spec.name in type(self).model_fields:
            value: PolicyParams = getattr(self, spec.name)
            return value
        return spec.params()

    def replace(self, **changes: Any) -> Self:
        """A copy with `changes`, validated (the frozen way to change a setting)."""
        return self.model_validate({**dict(self), **changes})


def _every_policy_is_declared() -> None:
    # A policy whose parameters were not declared here would silently run on their
    # defaults whatever `router:` says: fail at import instead.
    owners: dict[str, str] = {name: "the core" for name in CoreFields.model_fields}
    for spec in policies.REGISTRY.values():
        fields = spec.params.model_fields
        if not fields:
            continue
        held = RoutingSettings.model_fields.get(spec.name)
        if held is None or held.annotation is not spec.params:
            raise TypeError(f"RoutingSettings has no field {spec.name}: "
                            f"{spec.params.__name__} for policy {spec.name}")
        for name in fields:
            if name in owners:
                raise TypeError(f"policy {spec.name}'s parameter {name} is also "
                                f"{owners[name]}'s (`router:` is one namespace)")
            if name not in RouterFields.model_fields:
                raise TypeError(f"policy {spec.name}'s parameter {name} is not in "
                                "RouterFields (add its field group to its bases)")
            owners[name] = spec.name


_every_policy_is_declared()
