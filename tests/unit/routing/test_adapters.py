"""LoRA adapters in the routing core: their requests are keyed apart from the base model's
and stay on the replicas that already run the adapter (routing/adapters.py)."""

from __future__ import annotations

from rayattn.config.schema import RouterConfig
from rayattn.routing.adapters import AdapterResidency
from rayattn.routing.core import Finished, RoutingCore

BS = 16
ADAPTERS = {"pirate": "/lora/pirate", "poet": "/lora/poet", "sage": "/lora/sage"}


def core(slots: int = 1, cached: int = 1, replicas: tuple[str, ...] = ("a", "b")) -> RoutingCore:
    c = RoutingCore(RouterConfig(index="predicted").routing_settings(), BS, adapters=ADAPTERS,
                    adapter_slots=slots, adapters_cached=cached)
    for name in replicas:
        assert c.joined(name, BS, 1000)
    return c


def prompt(i: int, n_blocks: int = 4) -> list[int]:
    return [i * 100_000 + t for t in range(n_blocks * BS + 3)]


def run(c: RoutingCore, ids: list[int], adapter: str | None) -> str:
    """One request through the whole lifecycle; the replica it ran on."""
    route = c.request(ids, adapter=adapter)
    d = c.choose(route, sorted(c.routable))
    c.dispatched(d, route)
    c.first_token(d)
    c.finished(d, route, Finished(len(ids), d.predicted_cached_tokens, [1, 2, 3], {}))
    c.ended(d)
    return d.replica


def test_an_adapters_new_conversations_stay_where_it_is_loaded():
    """One adapter kept per engine (max_cpu_loras 1): both start holding the last one
    loaded (sage); pirate's requests stay where the first one loaded it."""
    c = core()
    assert all(c.adapters.holds(r, "sage") and not c.adapters.holds(r, "pirate")
               for r in ("a", "b"))
    where = {run(c, prompt(i), "pirate") for i in range(12)}
    assert len(where) == 1
    # The control: the same prompts on the base model spread by their own keys.
    assert len({run(c, prompt(100 + i), None) for i in range(12)}) == 2


def test_adapters_every_engine_holds_spread_like_the_base_model():
    """With room for all adapters (max_cpu_loras 3) every engine loaded them all at start:
    nothing to keep together."""
    c = core(cached=3)
    assert len({run(c, prompt(i), "pirate") for i in range(12)}) == 2


def test_the_same_prompt_under_another_adapter_is_not_a_hit():
    c = core()
    ids = prompt(1)
    first = run(c, ids, "pirate")
    again = c.choose(c.request(ids, adapter="pirate"), ["a", "b"])
    assert again.replica == first and again.predicted_cached_tokens == 4 * BS
    for other in ("poet", None):
        d = c.choose(c.request(ids, adapter=other), ["a", "b"])
        assert d.predicted_cached_tokens == 0, other


def test_a_busy_slot_costs_more_than_loading_the_adapter_elsewhere():
    """One adapter per batch (max_loras 1), two kept per engine: `a` holds poet and sage,
    `b` sage and pirate. While `a` runs sage, a poet request would wait there for a slot, so
    it goes to `b` and loads poet there; once `a`'s slot is free, poet is cheapest where it
    is loaded."""
    c = core(slots=1, cached=2)
    run_on = {"a": None, "b": "pirate"}
    for replica, adapter in run_on.items():
        if adapter:
            c.adapters.dispatched(replica, adapter)
            c.adapters.ended(replica, adapter)
    assert c.adapters.holds("a", "poet") and not c.adapters.holds("b", "poet")
    route = c.request(prompt(1), adapter="sage")
    d = c.choose(route, ["a"])
    c.dispatched(d, route)
    assert c.adapters.waits_for_slot("a", "poet")
    assert c.choose(c.request(prompt(2), adapter="poet"), ["a", "b"]).replica == "b"
    c.ended(d)
    assert not c.adapters.waits_for_slot("a", "poet")
    assert c.choose(c.request(prompt(3), adapter="poet"), ["a", "b"]).replica == "a"


def test_the_slot_wait_is_the_output_requests_run_to_not_their_cap():
    """Requests seen to end after 4 tokens free `a`'s slot long before loading poet on `b`
    would be done: poet waits where it is loaded, though no max_tokens is sent (the
    256-token cap alone would send it to load elsewhere)."""
    c = core(slots=1, cached=2)
    c.adapters.dispatched("b", "pirate")
    c.adapters.ended("b", "pirate")
    route = c.request(prompt(1), adapter="sage")
    c.dispatched(c.choose(route, ["a"]), route)
    assert c.adapters.waits_for_slot("a", "poet")
    assert c.choose(c.request(prompt(2), adapter="poet"), ["a", "b"]).replica == "b"
    c.policy.cost.observe_output(4)
    assert c.choose(c.request(prompt(3), adapter="poet"), ["a", "b"]).replica == "a"


def test_residency_is_vllms_lru_and_a_replica_that_leaves_holds_nothing():
    res = AdapterResidency(slots=1, cached=2)
    for name in ("x", "y", "x", "z"):  # z evicts y, the least recently used
        res.dispatched("r", name)
        res.ended("r", name)
    assert [res.holds("r", n) for n in ("x", "y", "z")] == [True, False, True]
    res.forget("r")
    assert not res.holds("r", "x")
    c = core()
    where = run(c, prompt(1), "pirate")
    c.left(where)
    assert c.joined(where, BS, 1000)  # back, restarted: its engine loaded what it starts with
    assert not c.adapters.holds(where, "pirate") and c.adapters.holds(where, "sage")


def test_an_unknown_adapter_is_refused_before_routing():
    import pytest

    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        core().request(prompt(1), adapter="nope")
