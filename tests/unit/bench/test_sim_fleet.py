"""The simulator's fleet that scales (rayattn/bench/sim_fleet.py): Serve's delays and bounds
around the shipped autoscaling policy, and engines that join warmed and leave with their
conversations moved, by the routing core's own plans."""

from __future__ import annotations

import pytest

from rayattn.bench.sim_fleet import Autoscaler, EngineSignals, FleetScaling, Members
from rayattn.bench.simulate import TIMELINE_S, EngineModel, ramp_trace, simulate
from rayattn.config.schema import EngineAutoscaling, RouterConfig

MODEL = EngineModel(prefill_s_per_token=6e-5, ctx_s_per_token=2e-7, itl_base_s=0.02,
                    itl_per_seq_s=2e-4, capacity_blocks=4096, block_size=32,
                    max_batched_tokens=8192, max_seqs=128)


def _scaling(start_s: float = 60.0, **auto) -> FleetScaling:
    """serve.engine_autoscaling as the simulator's tests run it: Serve's loop every second,
    a 3-s look-back, a TTFT target of 1 s unless given, requests in flight no signal."""
    settings = {"min_replicas": 1, "ttft_p90_s": 1.0, "target_ongoing_requests": 1e9,
                "metrics_interval_s": 1.0, "look_back_period_s": 3.0, "upscale_delay_s": 1.0,
                **auto}
    return FleetScaling(EngineAutoscaling(**settings), start_s=start_s)


def _busy(ttft_s: float, at: float = 0.0, n: int = 20) -> EngineSignals:
    """An engine whose `n` first tokens at `at` took `ttft_s`."""
    sig = EngineSignals()
    for _ in range(n):
        sig.first_token(at, ttft_s)
    return sig


def test_serve_applies_a_wish_only_once_it_held_for_the_delay_and_within_the_bounds():
    a = Autoscaler(_scaling(max_replicas=3, upscale_delay_s=2.0, downscale_delay_s=5.0),
                   initial=1)
    # Four times the target: the policy doubles at most; Serve waits 2 s for it.
    assert a.tick(0.0, {"e0": _busy(4.0)}, 10) == 1
    assert a.tick(1.0, {"e0": _busy(4.0)}, 10) == 1
    assert a.tick(2.0, {"e0": _busy(4.0)}, 10) == 2
    # Still over, two engines running: more, but never past max_engines.
    assert [a.tick(t, {"e0": _busy(9.0, t), "e1": _busy(9.0, t)}, 10)
            for t in (30, 31, 32)] == [2, 2, 3]
    # Idle (no latency samples, no KV): shrink after the down-scale delay only; a wish to
    # grow in between starts the wait anew.
    idle = {"e0": EngineSignals(), "e1": EngineSignals(), "e2": EngineSignals()}
    assert a.tick(60.0, idle, 0) == 3
    assert a.tick(64.0, idle, 0) == 3
    assert a.tick(65.0, {"e0": _busy(9.0, 65.0)}, 5) == 3
    assert a.tick(66.0, idle, 0) == 3
    assert a.tick(70.0, idle, 0) == 3
    # Five seconds of it: half the engines at most per decision (rounded up), not one.
    assert a.tick(71.0, idle, 0) == 2
    assert [d[1] for d in a.decisions] == [2, 3, 2]


def test_the_engines_signals_are_their_last_windows():
    sig = EngineSignals()
    for t in range(20):
        sig.first_token(float(t), 0.1 if t < 10 else 2.0)
        sig.step(0.5)
    p90, n, kv = sig.report(20.0, look_back_s=3.0)
    assert n == 10 and p90 == 2.0 and kv == 0.5  # the last 10 s of first tokens
    assert sig.report(21.0, look_back_s=3.0)[2] == 0.25  # no step since: 0, averaged


def test_fleet_scaling_runs_rayattns_policy_on_the_schemas_settings():
    with pytest.raises(ValueError, match="target"):
        FleetScaling(EngineAutoscaling(max_replicas=2))  # Serve's default policy, not ours
    with pytest.raises(ValueError, match="min_replicas"):
        _scaling(min_replicas=3, max_replicas=2)
    # The policy is the one Serve runs for this config (its kwargs, as serve_config says).
    auto = EngineAutoscaling(max_replicas=4, kv_usage=0.5, hold_band=0.4)
    kwargs = auto.serve_config()["policy"]["policy_kwargs"]
    assert FleetScaling(auto).policy().targets == {"kv_usage": 0.5} and \
        kwargs == {"kv_usage": 0.5, "hold_band": 0.4}


@pytest.fixture(scope="module")
def ramp():
    return ramp_trace([(30, 6), (60, 30), (60, 6)], turns=4, shared_systems=4,
                      system_tokens=1024, user_tokens=128, output_tokens=32, think_s=5.0,
                      block_size=32, seed=1, document_tokens=512)


def test_the_trace_routes_on_the_routers_own_keys(ramp):
    """A scaling fleet routes through the routing core's hashing (it remembers what each
    conversation sent, for its plans): its keys must be the trace's, or the simulated
    engines' caches and the router's view would never meet."""
    from rayattn.routing.core import RoutingCore

    core = RoutingCore(RouterConfig().routing_settings(), 32)
    for r in ramp[:50]:
        assert r.ids is not None
        assert core.request(r.ids[:r.prompt_tokens].tolist(), r.session).keys == r.keys


@pytest.mark.parametrize("warm", [True, False])
def test_a_ramp_grows_the_fleet_and_shrinks_it_back_losing_nothing(ramp, warm):
    scaling = _scaling(max_replicas=6, ttft_p90_s=0.5, downscale_delay_s=20, start_s=10)
    r = simulate(ramp, 1, "affinity", MODEL, index="events", scaling=scaling, seed=1,
                 router_cfg=RouterConfig(warm_engines=warm))
    assert r.requests == len(ramp)
    assert 1 < r.max_engines <= 6
    grew = [d for d in r.scale_decisions if d[1] > 1]
    assert grew and grew[0][2]["ttft_p90_s"] > 1  # the latency target asked for it
    assert r.scale_decisions[-1][1] == 1  # back to the minimum once the peak ended
    engines = [w["engines"] for w in r.timeline]
    peak = max(range(len(engines)), key=engines.__getitem__)
    assert engines[0] == 1 and engines[peak] > 1 and engines[-1] <= 1
    # Engine-seconds count every engine from its start (while it loads, too): more than the
    # engines serving over the timeline, by at least start_s for each engine that joined.
    serving_s = sum(w["engines"] for w in r.timeline) * TIMELINE_S
    assert r.engine_seconds >= serving_s + (r.max_engines - 1) * scaling.start_s - 1e-6
    if warm:
        # Engines that joined got the conversations' shared system prompts, and the
        # conversations of engines that left were prefilled where they went.
        assert r.warm_prefills > 0 and r.moved_conversations > 0
    else:
        assert r.warm_prefills == r.moved_conversations == 0


def test_a_joining_engine_is_held_until_warmed_and_a_leaving_ones_conversations_move():
    from rayattn.routing.core import RoutingCore
    from rayattn.routing.prefix_index import PrefixIndex

    now = [0.0]
    core = RoutingCore(RouterConfig().routing_settings(), 16, clock=lambda: now[0])
    sent: list[tuple[str, list[int], object]] = []
    members = Members(["e0", "e1", "e2"], 1, [core], PrefixIndex(), 4096, 64, RouterConfig(),
                      lambda target, ids, done: sent.append((target, ids, done)))
    system = list(range(1, 65))  # four blocks every conversation starts with
    for k in range(3):
        route = core.request(system + [1000 + k] * 40, f"s{k}")
        core.dispatched(core.choose(route, members.routable()), route)
    # e1 joins while e0 serves: held out of routing until the shared prompt is prefilled.
    members.join("e1", 1.0, members.start(1.0)[1])
    assert [(t, ids) for t, ids, _ in sent] == [("e1", system)]
    assert members.routable() == ["e0"] and members.held == {"e1": 1}
    sent.pop()[2]()
    assert members.routable() == ["e0", "e1"] and not members.held
    # e2 joins and times out before its prefill ran: it serves cold.
    start = members.start(2.0)[1]
    members.join("e2", 2.0, start)
    assert members.routable() == ["e0", "e1"]
    members.hold_expired("e2", start - 1)  # an earlier start's timeout: not this hold's
    assert members.routable() == ["e0", "e1"]
    members.hold_expired("e2", start)
    assert members.routable() == ["e0", "e1", "e2"]
    sent.clear()
    # A conversation on the newest engine, which Serve stops first: its history is
    # prefilled where its next turn goes, and that is where the next turn goes.
    route = core.request(system + [7] * 40, "late")
    d = core.choose(route, ["e2"])
    core.dispatched(d, route)
    core.ended(d)
    assert members.leave(3.0) == "e2" and members.routable() == ["e0", "e1"]
    [(target, ids, done)] = sent
    assert target in ("e0", "e1") and ids == system + [7] * 40  # its last prompt
    done()
    assert members.moved == 1
    nxt = core.request(system + [7] * 40 + [8] * 20, "late")
    assert core.choose(nxt, members.routable()).replica == target
    members.depart("e2", 4.0)
    assert members.active == ["e0", "e1"]
    # Never the last engine: nothing to stop.
    members.leave(5.0)
    assert members.leave(6.0) is None and members.serving() == ["e0"]
