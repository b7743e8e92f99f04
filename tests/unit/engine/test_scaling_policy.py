"""rayattn.engine.scaling_policy and load_signals: engines for the most pressed target, run
inside Serve's own wrapper (bounds, delays) with Serve's AutoscalingContext; what an engine
reports; the targets from the config to Serve's autoscaling_config and back."""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from rayattn.config.schema import SCALING_POLICY, SCALING_TARGETS, EngineAutoscaling
from rayattn.engine.load_signals import WINDOW_S, LoadSignals, WindowedLatency
from rayattn.engine.scaling_policy import (
    BREACH_MEMORY_S,
    MIN_SAMPLES,
    ONGOING,
    SIGNALS,
    EnginesForTargets,
    engines_for,
    fleet_latency,
)


def test_engines_follow_the_most_pressed_target_with_a_hold_band():
    assert engines_for(2, 2, {ONGOING: 0.5, "kv_usage": 1.5}, 0.6) == 3
    assert engines_for(1, 1, {ONGOING: 2.7}, 0.6) == 3
    assert engines_for(3, 3, {ONGOING: 1.01}, 0.6) == 4        # just above: one more
    assert engines_for(4, 4, {ONGOING: 0.9, "ttft_p90_s": 0.61}, 0.6) == 4  # in the band
    assert engines_for(4, 4, {ONGOING: 0.3, "kv_usage": 0.25}, 0.6) == 2
    assert engines_for(2, 2, {ONGOING: 0.0}, 0.6) == 1         # never below one
    assert engines_for(8, 8, {ONGOING: 0.0}, 0.6) == 4         # at most half at once
    assert engines_for(3, 3, {}, 0.6) == 3                      # nothing known: stay
    # No flapping: after a shrink the highest pressure lands at or under the band, so the
    # next decision never grows the fleet back (it may shrink it further, by halves).
    for current in range(1, 17):
        for top in (0.05, 0.2, 0.35, 0.5, 0.59):
            after = engines_for(current, current, {ONGOING: top}, 0.6)
            assert after <= current and top * current / after <= 0.6 + 1e-9
            assert engines_for(after, after, {ONGOING: top * current / after}, 0.6) <= after


def test_a_latency_grows_the_fleet_at_most_twofold_at_once():
    """Latency does not divide over engines as requests in flight do: a TTFT 5x its target
    doubles the fleet, it does not quintuple it; KV five times over does."""
    assert engines_for(2, 2, {"ttft_p90_s": 5.0, ONGOING: 0.1}, 0.6) == 4
    assert engines_for(2, 2, {"itl_p90_s": 1.2}, 0.6) == 3
    assert engines_for(2, 2, {"kv_usage": 5.0}, 0.6) == 10


def test_a_shrink_never_lands_above_the_target():
    """Five running while Serve aims for two (a surge, a lowered maximum): an answer above
    two would count as a scale-up in Serve's delays."""
    assert engines_for(5, 2, {ONGOING: 0.0}, 0.6) == 2


def test_replicas_still_starting_or_gone_keep_the_count_serve_aims_for():
    """Serve's delays compare a decision with its target, which counts replicas still
    starting: holding means the target, or the engine that loads would be cancelled."""
    assert engines_for(2, 3, {ONGOING: 0.8}, 0.6) == 3      # in the band, one starting
    assert engines_for(2, 3, {ONGOING: 1.2}, 0.6) == 3      # growing: at least the target
    assert engines_for(0, 2, {}, 0.6) == 2                   # none running (yet)
    assert engines_for(0, 2, {"kv_usage": 2.0}, 0.6) == 2


def _ctx(metrics: dict[str, dict[str, float]], current: int, ongoing: float = 0.0,
         target_ongoing: float = 2.0, lo: int = 1, hi: int = 8, delay_s: float = 0,
         target: int | None = None, scaled_up_s_ago: float | None = None, at: float = 0.0):
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    dep = DeploymentID(name="engine", app_name="rayattn")
    ids = {f"r{i}": ReplicaID(unique_id=f"r{i}", deployment_id=dep) for i in range(current)}
    config = AutoscalingConfig(min_replicas=lo, max_replicas=hi, upscale_delay_s=delay_s,
                               downscale_delay_s=delay_s, look_back_period_s=15,
                               target_ongoing_requests=target_ongoing)
    return AutoscalingContext(
        deployment_id=dep, deployment_name="engine", app_name="rayattn",
        current_num_replicas=current,
        target_num_replicas=current if target is None else target,
        running_replicas=list(ids.values()), total_num_requests=ongoing,
        total_queued_requests=0,
        aggregated_metrics={m: {ids[k]: v for k, v in per.items()} for m, per in
                            metrics.items()},
        raw_metrics={}, capacity_adjusted_min_replicas=lo, capacity_adjusted_max_replicas=hi,
        policy_state={}, last_scale_down_time=None, current_time=time.time() + at,
        last_scale_up_time=None if scaled_up_s_ago is None else
        time.time() + at - scaled_up_s_ago,
        config=config)


def test_pressures_are_the_fleets_signals_over_their_targets():
    policy = EnginesForTargets(ttft_p90_s=0.5, kv_usage=0.8)
    got = policy.pressures(_ctx({"ttft_p90_s": {"r0": 0.4, "r1": 0.8},
                                 "ttft_samples": {"r0": 10, "r1": 10},
                                 "kv_usage": {"r0": 0.2, "r1": 0.0},
                                 "itl_p90_s": {"r0": 9.0}, "itl_samples": {"r0": 99}},
                                current=2, ongoing=6))
    # ttft: 0.6 of 0.5 (equal samples); kv: mean 0.1 of 0.8; requests: 6 over 2 engines × 2;
    # the ITL reported has no target here and is no signal.
    assert got == pytest.approx({"ttft_p90_s": 1.2, "kv_usage": 0.125, ONGOING: 1.5})
    # A latency with (almost) no traffic behind it is left out, not read as 0.
    assert "ttft_p90_s" not in policy.pressures(_ctx(
        {"kv_usage": {"r0": 0.1}, "ttft_p90_s": {"r0": 9.0}, "ttft_samples": {"r0": 2}},
        current=1))


def _ttft(p90: float, *samples: int) -> dict[str, dict[str, float]]:
    """Every engine at `p90`, with its share of the fleet's first tokens."""
    return {"ttft_p90_s": {f"r{i}": p90 for i in range(len(samples))},
            "ttft_samples": {f"r{i}": n for i, n in enumerate(samples)}}


def test_a_fleet_holds_the_engines_its_load_broke_a_latency_target_without():
    """Two engines far under a TTFT target can be one engine far over it (queueing near
    saturation; seen on a GPU ramp, where the fleet went 2 -> 1 -> 2 at its peak): the
    policy remembers the load per engine at which the target broke and does not shrink
    below what the load now needs at the hold band of it; once the load goes, it shrinks."""
    policy = EnginesForTargets(ttft_p90_s=0.3)
    # One engine, 120 first tokens in its window at p90 0.5 s: over target, two engines.
    assert policy(_ctx(_ttft(0.5, 120), current=1))[0] == 2
    # Two carry 150 at 0.08 s, a quarter of the target: one engine would break it again.
    peak = _ctx(_ttft(0.08, 75, 75), current=2)
    held, state = policy(peak)
    assert held == 2 and state["load_floor"] == 3  # 150 / (0.6 * 120 per engine)
    assert EnginesForTargets(ttft_p90_s=0.3)(peak)[0] == 1  # what it did without the memory
    # The quiet after the peak: 20 first tokens, back to one engine.
    shrunk, state = policy(_ctx(_ttft(0.05, 10, 10), current=2))
    assert shrunk == 1 and state["load_floor"] == 1


def test_a_latency_from_before_a_scale_up_teaches_no_load():
    """Right after a scale-up the latency may still be the smaller fleet's: read against
    the grown fleet it would halve what one engine carries, and hold engines for nothing."""
    policy = EnginesForTargets(ttft_p90_s=0.3)
    assert policy(_ctx(_ttft(0.9, 60, 60), current=2, target=4, scaled_up_s_ago=1))[0] == 4
    assert policy.capacity.per_engine(time.time()) is None
    assert policy(_ctx(_ttft(0.9, 60, 60), current=2, scaled_up_s_ago=600))[0] == 4
    assert policy.capacity.per_engine(time.time()) == 60


def test_an_engine_that_joins_long_after_the_decision_settles_before_it_counts():
    """Serve's last_scale_up_time is the decision; an engine serves tens of seconds after
    it. When it joins, the old engine's latency is still the one engine's, and the new one
    has none: read against two engines it would halve what an engine carries. It still
    grows the fleet: on a ramp engines join one after another, and a fleet that could not
    grow while they did fell behind (docs/log/autoscale-ramp.md, the simulator's ramp)."""
    policy = EnginesForTargets(ttft_p90_s=0.3)
    assert policy(_ctx(_ttft(0.5, 120), current=1, scaled_up_s_ago=600))[0] == 2
    joined = _ctx(_ttft(0.5, 120, 0), current=2, scaled_up_s_ago=60)
    assert policy(joined)[0] > 2
    assert policy.capacity.per_engine(time.time()) == 120  # not 60


def test_the_highest_recent_breach_bounds_a_shrink():
    """A target also breaks while a backlog drains, at a load each engine carries: the
    highest load per engine of the recent breaches bounds a shrink, and breaches older
    than BREACH_MEMORY_S are forgotten (the workload changes)."""
    policy = EnginesForTargets(ttft_p90_s=0.3)
    policy(_ctx(_ttft(0.5, 120), current=1))       # 120 per engine: a load breach
    policy(_ctx(_ttft(0.9, 5, 5, 5, 5), current=4))  # 5 per engine: a backlog draining
    assert policy.capacity.per_engine(time.time()) == 120
    # 60 over four engines, far under the target: one carries it (60 / (0.6 * 120) -> 1);
    # by the last breach (5 per engine) it would take 20, and the fleet would stay at four.
    shrunk, state = policy(_ctx(_ttft(0.05, 15, 15, 15, 15), current=4))
    assert shrunk == 2 and state["load_floor"] == 1  # at most half at once
    assert policy.capacity.per_engine(time.time() + BREACH_MEMORY_S) is None


def test_serve_runs_the_policy_within_its_delays():
    """Serve's wrapper of a custom policy (the one its controller applies: delays)."""
    from ray.serve.autoscaling_policy import _apply_autoscaling_config

    policy = _apply_autoscaling_config(EnginesForTargets(kv_usage=0.5))
    # KV over its target on one engine, few requests: the KV signal asks for two.
    up, state = policy(_ctx({"kv_usage": {"r0": 0.9}}, current=1, ongoing=1, hi=2))
    assert up == 2 and state["pressures"]["kv_usage"] == pytest.approx(1.8)
    # A third engine starting, the pressure in the band: Serve keeps it coming.
    assert policy(_ctx({"kv_usage": {"r0": 0.4, "r1": 0.4}}, current=2, target=3))[0] == 3
    # The highest pressure decides (Serve's deployment state bounds it afterwards).
    assert policy(_ctx({"kv_usage": {"r0": 1.0}}, current=1, ongoing=50))[0] == 25
    # Idle: no latency reported, KV empty, nothing in flight: back to the minimum.
    assert policy(_ctx({"kv_usage": {"r0": 0.0, "r1": 0.0}}, current=2, lo=1))[0] == 1
    # With a delay, the first tick that asks for more keeps the count and starts the clock.
    held, state = policy(_ctx({"kv_usage": {"r0": 0.9}}, current=1, hi=2, delay_s=30))
    assert held == 1 and state["__decision_timestamp"] is not None


def test_an_engine_reports_its_kv_usage_and_the_windows_latency_percentiles():
    now = [100.0]
    s = LoadSignals(clock=lambda: now[0])
    idle = {"kv_usage": 0.0, "ttft_p90_s": 0.0, "ttft_samples": 0, "itl_p90_s": 0.0,
            "itl_samples": 0}
    assert s.read() == idle  # no step, no request: no KV used, no latency, every key
    s.record(0.2, [0.1] * 8 + [0.3, 0.5], [0.01] * 9 + [0.05])
    s.record(0.4, [], [0.02])
    s.record(None, [0.2], [])  # an output without scheduler stats
    got = s.read()
    assert got == {"kv_usage": pytest.approx(0.3), "ttft_p90_s": 0.3, "ttft_samples": 11,
                   "itl_p90_s": 0.02, "itl_samples": 11}
    # KV usage covers the time since the last report; latencies the last WINDOW_S seconds,
    # however often Serve asks.
    now[0] += 1
    assert s.read() == {**got, "kv_usage": 0.0}
    now[0] += WINDOW_S + 1
    assert s.read() == idle


def test_a_latency_counts_with_enough_samples_over_the_fleet_weighted_by_them():
    """One engine's few requests are no p90, but the fleet's are: a fleet that grew keeps
    its signal though each engine sees fewer requests; an idle engine weighs nothing."""
    assert fleet_latency({"a": 2.0}, {"a": MIN_SAMPLES - 1}) is None
    assert fleet_latency({"a": 2.0, "b": 1.0}, {"a": 6, "b": 6}) == 1.5
    assert fleet_latency({"a": 2.0, "b": 0.0}, {"a": 30, "b": 0}) == 2.0
    assert fleet_latency({"a": 3.0, "b": 1.0}, {"a": 10, "b": 30}) == 1.5
    assert fleet_latency(None, None) is None


def test_the_latency_sample_stays_bounded_and_weighs_each_second_by_its_traffic():
    """A busy engine makes thousands of tokens a second: a uniform sample of each second,
    weighted by what that second saw, not the last few tokens' worth."""
    now = [0.0]
    w = WindowedLatency(per_bucket=100, clock=lambda: now[0])
    w.offer([1.0] * 10_000)                  # a busy second of slow tokens
    now[0] += 1
    w.offer([0.1] * 1_000)                   # a quiet second of fast ones
    assert sum(len(b.values) for b in w.buckets.values()) == 200
    assert w.p90() == (1.0, 11_000)          # 10,000 of 11,000 were slow
    now[0] += 1
    w.offer([0.1] * 100_000)
    assert w.p90() == (0.1, 111_000)         # now 101,000 of 111,000 are fast
    now[0] += WINDOW_S + 2
    assert w.p90() == (0.0, 0) and not w.buckets


def test_targets_go_to_serve_as_rayattns_policy_and_come_back_from_a_serve_config():
    auto = EngineAutoscaling(min_replicas=1, max_replicas=4, kv_usage=0.8, ttft_p90_s=1.5)
    serve = auto.serve_config()
    assert serve["policy"] == {"policy_function": SCALING_POLICY, "policy_kwargs": {
        "ttft_p90_s": 1.5, "kv_usage": 0.8, "hold_band": 0.6}}
    assert "kv_usage" not in serve and serve["max_replicas"] == 4
    # What `rayattn check` reads from the Serve config's engine entry is the same setting.
    assert EngineAutoscaling(**serve) == auto
    # Serve's own policy where no target is set: the config Serve gets has none.
    assert "policy" not in EngineAutoscaling(max_replicas=2).serve_config()
    with pytest.raises(ValidationError, match="only rayattn's engine policy"):
        EngineAutoscaling(policy={"policy_function": "my.module:policy"})
    # Serve would instantiate the policy with whatever the kwargs say.
    for kwargs in ({"min_replicas": 3, "kv_usage": 0.5}, {}, {"hold_band": 0.5}):
        with pytest.raises(ValidationError, match="policy_kwargs"):
            EngineAutoscaling(policy={"policy_function": SCALING_POLICY,
                                      "policy_kwargs": kwargs})
    # The policy checks what a Serve config hands Serve's controller directly.
    with pytest.raises(ValueError, match="hold_band"):
        EnginesForTargets(hold_band=1.5, kv_usage=0.5)
    with pytest.raises(ValueError, match="at least one"):
        EnginesForTargets()
    assert SCALING_TARGETS == SIGNALS  # one set of names on both sides of the layers
    with pytest.raises(ValidationError, match="kv_usage"):
        EngineAutoscaling(kv_usage=1.5)


def test_serve_loads_the_policy_it_is_given_by_value_with_its_targets():
    """Serve's own config model takes what engine_options hands it; its controller's
    loader unpickles the class and instantiates it with the targets."""
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.config import AutoscalingConfig

    cfg = AutoscalingConfig(**EngineAutoscaling(max_replicas=3, itl_p90_s=0.05).serve_config())
    cfg.policy.serialize_policy()
    policy = _resolve_policy_callable(cfg.policy)
    assert policy.targets == {"itl_p90_s": 0.05} and policy.hold_band == 0.6
    # Inter-token p90 twice the target on the one engine: a second.
    assert policy(_ctx({"itl_p90_s": {"r0": 0.1}, "itl_samples": {"r0": 50}},
                       current=1))[0] == 2
    # ...but not again while that latency is from before the last scale-up.
    ctx = _ctx({"itl_p90_s": {"r0": 0.1, "r1": 0.1}, "itl_samples": {"r0": 50, "r1": 50}},
               current=2)
    ctx.last_scale_up_time = ctx.current_time - 5
    assert policy(ctx)[0] == 2


def test_a_breach_below_what_the_fleet_carried_does_not_hold_it():
    """On the CPU ramp an opening burst broke the target at 10 first tokens per engine (the
    window just filling); later three engines carried 33 each within it. What an engine
    carries is then at least 33: the quiet after the peak (25 over three) may shrink, where
    the breach alone (25 / (0.6 * 10) -> 5) held all three for half an hour."""
    policy = EnginesForTargets(ttft_p90_s=1.5)
    assert policy(_ctx(_ttft(2.6, 10), current=1))[0] == 2
    policy(_ctx(_ttft(0.5, 20, 20, 20), current=3, at=100))  # just joined: nothing learnt
    assert policy.capacity.per_engine(time.time() + 100) == 10
    policy(_ctx(_ttft(0.5, 33, 33, 33), current=3, at=200))
    assert policy.capacity.per_engine(time.time() + 200) == 33
    shrunk, state = policy(_ctx(_ttft(0.48, 8, 8, 9), current=3, at=210))
    assert state["load_floor"] == 2 and shrunk == 2
    # Carrying alone teaches nothing: without a breach there is no floor.
    fresh = EnginesForTargets(ttft_p90_s=1.5)
    fresh(_ctx(_ttft(0.5, 33, 33, 33), current=3))
    assert fresh.capacity.per_engine(time.time()) is None


def test_a_load_rising_toward_what_broke_a_target_grows_the_fleet_before_it_breaks():
    """A latency target breaks at queueing's knee, within seconds, and an engine takes tens
    of seconds to serve (docs/results.md, the GPU ramps): growing on the breach is late.
    The policy times the fleet's starts and grows where the load, that far ahead on its
    trend, reaches what broke the target before."""
    policy = EnginesForTargets(ttft_p90_s=0.3)
    assert policy(_ctx(_ttft(0.5, 120), current=1))[0] == 2  # broke at 120 per engine
    # The second engine serves 40 s after the decision; the peak, then the quiet.
    policy(_ctx(_ttft(0.1, 60, 60), current=2, at=40, scaled_up_s_ago=40))
    assert policy.start_s(time.time() + 40) == pytest.approx(40, abs=1)
    policy(_ctx(_ttft(0.05, 20), current=1, at=700))
    # The next rise, every latency far within the target: 40, then 60 five seconds later
    # (4 per second: 220 in 40 s, two engines' worth).
    assert policy(_ctx(_ttft(0.1, 40), current=1, at=809))[0] == 1
    up, state = policy(_ctx(_ttft(0.1, 60), current=1, at=814))
    assert up == 2 and state["ahead"] == 2
    # Serve's upscale delay is looked ahead too: a second later, 20 over 6 s for 40 + 40 s
    # (60 + 267: three engines' worth, two without the delay).
    assert policy(_ctx(_ttft(0.1, 60), current=1, at=815, delay_s=40))[1]["ahead"] == 3
    # A flat load, at what one engine was seen to break at less than: no growth.
    for at in (900, 905, 910):
        assert policy(_ctx(_ttft(0.1, 100), current=1, at=at))[0] == 1
    # An engine leaving: the fleet's summed load drops and climbs back as the window
    # refills, which is no rise of what users send (before, it grew the fleet straight back).
    policy(_ctx(_ttft(0.1, 50, 50), current=2, at=1000))
    for at, load in ((1001, 50), (1006, 75), (1011, 100)):
        assert policy(_ctx(_ttft(0.1, load), current=1, at=at))[1]["ahead"] == 0
    # Without the memory (no breach seen), or where the breach was a burst's below what an
    # engine carried, the same rise waits for the latency.
    for first in ((0.1, 20), (2.6, 10)):
        other = EnginesForTargets(ttft_p90_s=0.3)
        other(_ctx(_ttft(*first), current=1))
        other(_ctx(_ttft(0.1, 30), current=1, at=30))  # carried within the target
        other.starts = {time.time(): 40.0}
        other(_ctx(_ttft(0.1, 40), current=1, at=809))
        assert other(_ctx(_ttft(0.1, 60), current=1, at=814))[0] == 1


def test_only_a_join_after_a_decision_times_an_engine_start():
    """A replica that replaces a crashed one joins long after the last scale-up decision:
    timed from it, the growth would look minutes ahead and ask for the maximum."""
    policy = EnginesForTargets(ttft_p90_s=0.3)
    policy(_ctx(_ttft(0.1, 10), current=1, scaled_up_s_ago=50))
    policy(_ctx(_ttft(0.1, 10, 10), current=2, at=10, scaled_up_s_ago=60))
    assert policy.start_s(time.time() + 10) == pytest.approx(60, abs=1)
    policy(_ctx(_ttft(0.1, 10), current=1, at=300, scaled_up_s_ago=350))  # a crash
    policy(_ctx(_ttft(0.1, 10, 10), current=2, at=320, scaled_up_s_ago=370))  # replaced
    assert policy.start_s(time.time() + 320) == pytest.approx(60, abs=1)
    fresh = EnginesForTargets(ttft_p90_s=0.3)  # a controller restarted since the decision
    fresh(_ctx(_ttft(0.1, 10), current=1, scaled_up_s_ago=3000))
    fresh(_ctx(_ttft(0.1, 10, 10), current=2, at=1, scaled_up_s_ago=3001))
    assert fresh.start_s(time.time() + 1) == 0.0
