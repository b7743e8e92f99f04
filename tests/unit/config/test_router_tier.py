"""rayattn.config.router_tier: the router tier's bounds from the fleet and the spare cores,
and the Serve options they become."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rayattn.app import router_options
from rayattn.config.router_tier import MAX_ROUTERS, RouterBounds, router_bounds, routing_targets
from rayattn.config.schema import RayAttnConfig


def cfg(kind: str = "rocm", **serve) -> RayAttnConfig:
    return RayAttnConfig.model_validate({
        "model": {"source": "/m"}, "platform": {"kind": kind},
        **({"engine": {"kv_cache_memory_bytes": 2**30}} if kind == "cpu" else {}),
        "parallelism": {"data_parallel_size": 2}, "serve": serve})


def test_accelerators_start_two_routers_per_target_within_half_the_spare_cores():
    c = cfg()
    assert routing_targets([c]) == 2
    assert router_bounds(c, 2, 30) == RouterBounds(4, 16)   # a 32-core host, 2 engines
    assert router_bounds(c, 2, 6) == RouterBounds(3, 6)     # few cores: half of them
    assert router_bounds(c, 8, 200) == RouterBounds(MAX_ROUTERS // 2, MAX_ROUTERS)
    assert router_bounds(c, 2, 0.5) == RouterBounds(1, 1)   # never none
    assert router_bounds(c, 2, None) == RouterBounds(4, MAX_ROUTERS)


def test_cpu_engines_leave_one_router_unless_told():
    assert router_bounds(cfg("cpu"), 2, 30) == RouterBounds(1, 1)
    told = cfg("cpu", router_tier={"max_replicas": 3})
    assert router_bounds(told, 2, 30) == RouterBounds(1, 3)


def test_the_floor_counts_the_engines_always_running_and_the_ceiling_their_most():
    auto = RayAttnConfig.model_validate({
        "model": {"source": "/m"}, "parallelism": {"dp_attention": True, "tensor_parallel_size": 2},
        "serve": {"engine_autoscaling": {"min_replicas": 2, "max_replicas": 8}}})
    dp = auto.parallelism.dp_ranks
    assert routing_targets([auto]) == 2 * dp and routing_targets([auto], most=True) == 8 * dp
    # Several models: their targets add up.
    assert routing_targets([auto, cfg()]) == 2 * dp + 2


def test_a_users_bounds_and_a_fixed_count_win():
    assert router_bounds(cfg(ingress_replicas=3), 2, 30) == RouterBounds(3, 3)
    c = cfg(router_tier={"min_replicas": 2, "max_replicas": 5})
    assert router_bounds(c, 8, 100) == RouterBounds(2, 5)
    # A floor above the derived ceiling raises the ceiling with it.
    assert router_bounds(cfg(router_tier={"min_replicas": 6}), 2, 4) == RouterBounds(6, 6)
    # A ceiling alone caps the derived floor too.
    assert router_bounds(cfg(router_tier={"max_replicas": 2}), 2, 30) == RouterBounds(2, 2)
    assert router_bounds(cfg(router_tier={"max_replicas": 3}), 1, 30) == RouterBounds(2, 3)
    with pytest.raises(ValidationError, match="min_replicas"):
        cfg(router_tier={"min_replicas": 3, "max_replicas": 2})


def test_autoscaled_bounds_become_serves_autoscaling_config_on_the_routers_cpu():
    c = cfg(router_tier={"target_cpu": 0.5, "upscale_delay_s": 7})
    opts = router_options(c, RouterBounds(4, 16))
    auto = opts["autoscaling_config"]
    assert "num_replicas" not in opts
    assert (auto["min_replicas"], auto["max_replicas"]) == (4, 16)
    assert auto["upscale_delay_s"] == 7
    assert auto["policy"] == {"policy_function": "rayattn.server.router_scaling:RoutersForCpu",
                              "policy_kwargs": {"target_cpu": 0.5}}
    assert "initial_replicas" not in auto  # Serve would return to it on every config change
    # What Serve's controller makes of it: the policy imported from its path, pickled by
    # value, instantiated with its kwargs, and called as Serve calls it.
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.config import AutoscalingConfig

    from tests.unit.server.test_router_scaling import _ctx
    serve_config = AutoscalingConfig(**auto)
    serve_config.policy.serialize_policy()
    policy = _resolve_policy_callable(serve_config.policy)
    assert policy.target_cpu == 0.5
    assert policy(_ctx({"a": 0.9, "b": 0.9}, current=2))[0] == 4
    fixed = router_options(c, RouterBounds(2, 2))
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
