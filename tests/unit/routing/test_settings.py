"""The routing core's typed settings (rayattn/routing/settings.py): declared once, derived
from RouterConfig in one place, frozen, and each policy built from its own parameters."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from rayattn.config.schema import RouterConfig
from rayattn.routing import policies
from rayattn.routing.core import RoutingCore
from rayattn.routing.load import LoadTracker
from rayattn.routing.policies import PolicyContext, PolicyParams
from rayattn.routing.policies.affinity import Affinity, AffinityFields, AffinityParams
from rayattn.routing.policies.ray_prefix import RayPrefix, RayPrefixFields, RayPrefixParams
from rayattn.routing.prefix_index import PrefixIndex
from rayattn.routing.settings import (
    CoreFields,
    RouterFields,
    RoutingSettings,
    _every_policy_is_declared,
)

# `router:` keys the routing settings had before they were typed: YAML keeps naming them so.
FLAT_NAMES = {
    "index", "speculative_ttl_s", "policy", "kv_admission", "conversation_idle_s",
    "kv_admission_fill", "kv_admission_protect", "dp_rank_routing", "load_epsilon",
    "load_slack", "min_match_fraction", "prefill_s_per_token", "extend_s_per_context_token",
    "decode_s_per_request", "reload_cost_fraction", "ray_prefix_match_rate_threshold",
    "ray_prefix_imbalanced_threshold", "weigh_queues_past_batch"}

# A value other than the default for every routing setting.
CHANGED = {
    "index": "predicted", "speculative_ttl_s": 7.0, "policy": "ray_prefix",
    "kv_admission": True, "conversation_idle_s": 9.0, "kv_admission_fill": 0.6,
    "kv_admission_protect": "running", "dp_rank_routing": False, "load_epsilon": 0.25,
    "load_slack": 2, "min_match_fraction": 0.3, "prefill_s_per_token": 3e-4,
    "extend_s_per_context_token": 2e-6, "decode_s_per_request": 4e-3,
    "reload_cost_fraction": 0.2, "ray_prefix_match_rate_threshold": 0.4,
    "ray_prefix_imbalanced_threshold": 3, "weigh_queues_past_batch": True}


def test_router_config_keeps_every_routing_setting_flat():
    assert set(RouterFields.model_fields) == FLAT_NAMES == set(CHANGED)
    assert FLAT_NAMES <= set(RouterConfig.model_fields)
    rc = RouterConfig.model_validate(yaml.safe_load(
        "policy: ray_prefix\nload_slack: 2\nray_prefix_imbalanced_threshold: 3\n"))
    dumped = rc.model_dump()
    assert dumped["load_slack"] == 2 and dumped["ray_prefix_imbalanced_threshold"] == 3
    assert not any(isinstance(v, dict) for k, v in dumped.items() if k in FLAT_NAMES)
    with pytest.raises(ValidationError):
        RouterConfig(affinity={"load_slack": 2})  # not a `router:` key: flat it stays
    rc.load_slack = 5  # the user-facing config stays mutable, and validated
    with pytest.raises(ValidationError):
        rc.load_slack = -1


def test_derivation_takes_every_routing_setting():
    rc = RouterConfig(**CHANGED)
    s = rc.routing_settings()
    assert isinstance(s, RoutingSettings)
    for name in CoreFields.model_fields:
        assert getattr(s, name) == CHANGED[name], name
    assert s.affinity == AffinityParams(**{k: CHANGED[k] for k in AffinityFields.model_fields})
    assert s.ray_prefix == RayPrefixParams(
        **{k: CHANGED[k] for k in RayPrefixFields.model_fields})
    assert RoutingSettings.of(rc) == s
    assert RouterConfig().routing_settings() == RoutingSettings()  # one set of defaults


def test_settings_and_params_are_frozen():
    s = RouterConfig().routing_settings()
    with pytest.raises(ValidationError):
        s.kv_admission = True  # type: ignore[misc]
    with pytest.raises(ValidationError):
        s.affinity.load_slack = 1  # type: ignore[misc]
    assert hash(s) == hash(RouterConfig().routing_settings())
    assert len({s, RouterConfig().routing_settings()}) == 1


def test_replace_is_a_new_validated_object():
    s = RouterConfig().routing_settings()
    t = s.replace(kv_admission=True, policy="sticky")
    assert (t.kv_admission, t.policy) == (True, "sticky")
    assert (s.kv_admission, s.policy) == ("auto", "affinity")  # the old one unchanged
    assert t.affinity is s.affinity
    with pytest.raises(ValueError, match="affinity, round_robin"):
        s.replace(policy="nope")
    with pytest.raises(ValidationError):
        s.replace(index="guessed")
    with pytest.raises(ValidationError):
        s.replace(no_such_setting=1)
    a = s.affinity.replace(load_slack=9)
    assert a.load_slack == 9 and s.affinity.load_slack == 4
    with pytest.raises(ValidationError):
        s.affinity.replace(load_epsilon=-1)


@pytest.mark.parametrize("name", list(policies.REGISTRY))
def test_each_policy_is_built_from_its_own_params(name):
    spec = policies.spec(name)
    assert issubclass(spec.params, PolicyParams)
    params = RouterConfig(**CHANGED).routing_settings().params(name)
    assert type(params) is spec.params
    assert params == spec.params.of(RouterConfig(**CHANGED))
    ctx = PolicyContext(PrefixIndex(), LoadTracker(), 16, seed=0)
    assert policies.build(name, ctx, params).name == name
    others = {type(p) for p in (AffinityParams(), RayPrefixParams(), PolicyParams())}
    for wrong in others - {spec.params}:
        with pytest.raises(TypeError, match=name):
            policies.build(name, ctx, wrong())


def test_affinity_reads_its_params():
    p = AffinityParams(load_epsilon=0.25, load_slack=2, min_match_fraction=0.3,
                       prefill_s_per_token=3e-4, extend_s_per_context_token=2e-6,
                       decode_s_per_request=4e-3, reload_cost_fraction=0.2)
    pol = policies.build("affinity", PolicyContext(PrefixIndex(), LoadTracker(), 16), p)
    assert isinstance(pol, Affinity)
    assert (pol.epsilon, pol.slack, pol.min_match_fraction) == (0.25, 2, 0.3)
    c = pol.cost
    assert (c.prefill_s_per_token, c.ctx_s_per_token, c.decode_s_per_request,
            c.reload_fraction) == (3e-4, 2e-6, 4e-3, 0.2)


def test_ray_prefix_reads_its_params():
    p = RayPrefixParams(ray_prefix_match_rate_threshold=0.4, ray_prefix_imbalanced_threshold=3)
    pol = policies.build("ray_prefix", PolicyContext(PrefixIndex(), LoadTracker(), 16), p)
    assert isinstance(pol, RayPrefix)
    assert (pol.match_rate_threshold, pol.imbalanced_threshold) == (0.4, 3)


def test_policies_without_parameters_read_none():
    s = RouterConfig(**CHANGED).routing_settings()
    for name in ("round_robin", "power_of_two", "sticky"):
        assert type(s.params(name)) is PolicyParams
        assert s.params(name) == PolicyParams()
        assert not policies.spec(name).params.model_fields


def test_the_core_holds_a_new_object_per_change():
    core = RoutingCore(RouterConfig(index="predicted").routing_settings(), 16)
    first = core.settings
    core.reconfigure(first.replace(kv_admission=False))
    assert core.settings is not first and first.kv_admission == "auto"
    assert core.settings.kv_admission is False
    before = core.settings
    assert core.reset("sticky") == "sticky"
    assert core.settings.policy == "sticky" and before.policy == "affinity"
    pol = core.policy
    # Another policy's parameters are not this one's: it keeps what it learned.
    core.reconfigure(core.settings.replace(affinity=AffinityParams(load_slack=1)))
    assert core.policy is pol


def test_an_undeclared_policy_fails_at_import(monkeypatch):
    class LonelyParams(PolicyParams):
        lonely_knob: int = 1
        """A parameter nobody declared in RouterFields."""

    spec = policies.PolicySpec("lonely", "a policy with undeclared parameters", LonelyParams,
                               lambda ctx, params: Affinity(ctx, cost=None, epsilon=0))
    monkeypatch.setitem(policies.REGISTRY, "lonely", spec)
    with pytest.raises(TypeError, match="RoutingSettings has no field lonely"):
        _every_policy_is_declared()


def _undocumented(cls: type[BaseModel]) -> list[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    missing = []
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and node.target.id != "model_config":
            nxt = body[i + 1] if i + 1 < len(body) else None
            if not (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                missing.append(f"{cls.__name__}.{node.target.id}")
    return missing


def test_every_routing_setting_is_documented():
    """Like tests/unit/config/test_plan.py's check of the schema: the doc strings are the
    reference, in the one place each setting is declared."""
    groups = [RoutingSettings, *RouterFields.__bases__]  # the core's and every policy's group
    assert {CoreFields, AffinityFields, RayPrefixFields} <= set(groups)
    assert [m for g in groups for m in _undocumented(g)] == []
