"""The fleet simulator, driving the real policy objects."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rayattn.bench.simulate import EngineModel, multi_turn_trace, shared_prefix_trace, simulate
from rayattn.config.schema import RouterConfig


@pytest.fixture(scope="module")
def sp_trace():
    return shared_prefix_trace(groups=32, prompts_per_group=20, system_tokens=512,
                               question_tokens=64, output_tokens=32, rate=50, seed=1)


MODEL = EngineModel(prefill_s_per_token=2e-5, ctx_s_per_token=2e-7, itl_base_s=0.01,
                    itl_per_seq_s=2e-4, capacity_blocks=600, block_size=32)


def test_affinity_beats_round_robin_and_stays_under_oracle(sp_trace):
    aff = simulate(sp_trace, 8, "affinity", MODEL)
    rr = simulate(sp_trace, 8, "round_robin", MODEL)
    assert aff.requests == rr.requests == len(sp_trace)
    assert rr.hit_rate < aff.hit_rate <= aff.oracle_hit_rate + 1e-9
    assert aff.ttft_p90_s <= rr.ttft_p90_s
    assert aff.max_replica_share < 0.5


def test_deterministic(sp_trace):
    a = simulate(sp_trace, 4, "power_of_two", MODEL, seed=3)
    b = simulate(sp_trace, 4, "power_of_two", MODEL, seed=3)
    assert (a.hit_rate, a.ttft_p90_s, a.per_replica) == (b.hit_rate, b.ttft_p90_s, b.per_replica)


def test_several_routers_lose_little_with_rendezvous_tie_breaking(sp_trace):
    one = simulate(sp_trace, 8, "affinity", MODEL, routers=1)
    four = simulate(sp_trace, 8, "affinity", MODEL, routers=4)
    rr = simulate(sp_trace, 8, "round_robin", MODEL)
    assert four.hit_rate > rr.hit_rate
    assert one.hit_rate - four.hit_rate < 0.1


def test_multi_turn_history_is_reused():
    tr = multi_turn_trace(conversations=40, turns=4, shared_systems=4, system_tokens=256,
                          user_tokens=32, output_tokens=32, rate=20, seed=2)
    aff = simulate(tr, 4, "affinity", MODEL)
    rr = simulate(tr, 4, "round_robin", MODEL)
    assert aff.hit_rate > rr.hit_rate
    assert aff.hit_rate > 0.8 * aff.oracle_hit_rate


def test_the_policy_refits_from_simulated_engine_timings():
    tr = multi_turn_trace(conversations=60, turns=3, shared_systems=4, system_tokens=256,
                          user_tokens=64, output_tokens=16, rate=5, seed=4)
    # The router starts believing prefill costs 100× what the modelled engine takes.
    cfg = RouterConfig(prefill_s_per_token=MODEL.prefill_s_per_token * 100)
    res = simulate(tr, 2, "affinity", MODEL, router_cfg=cfg)
    learned = res.learned["prefill_s_per_token"]
    assert learned < MODEL.prefill_s_per_token * 10  # refitted from what the engines did


def test_a_conversations_turns_reach_one_router():
    """As the front door hashes the session header: with four routers, sticky routing (each
    router's own memory of a conversation's engine) keeps every conversation's history.
    Routed round the routers by turn, each turn met a router that had not seen the one
    before, and sticky recomputed histories (0.89–0.93 of the oracle here)."""
    tr = multi_turn_trace(conversations=24, turns=4, shared_systems=2, system_tokens=128,
                          user_tokens=32, output_tokens=8, rate=1000, seed=6)
    for concurrency in (None, 8):
        res = simulate(tr, 2, "sticky", MODEL, routers=4, concurrency=concurrency)
        assert res.hit_rate >= 0.97 * res.oracle_hit_rate, (concurrency, res.hit_rate)


def test_closed_loop_keeps_concurrency_conversations_in_flight():
    tr = multi_turn_trace(conversations=12, turns=3, shared_systems=2, system_tokens=128,
                          user_tokens=32, output_tokens=8, rate=1000, seed=5)
    one = simulate(tr, 2, "round_robin", MODEL, concurrency=1)
    four = simulate(tr, 2, "round_robin", MODEL, concurrency=4)
    assert one.requests == four.requests == len(tr)
    # One conversation at a time: every request alone, so the run takes about four times
    # as long as four at a time on two replicas (not exactly: batching is cheaper).
    assert one.sim_wall_s > 1.5 * four.sim_wall_s
    assert one.ttft_p90_s <= four.ttft_p90_s


def test_simulated_hits_follow_vllms_rule():
    # Prompts of exactly two blocks, the same prompt twice, one replica: the second request
    # gets one block from cache (vLLM always computes the last token), never both.
    from rayattn.bench.simulate import SimRequest

    keys = [11, 12]
    trace = [SimRequest(t, keys, 64, keys + [13], 2, f"s{t}") for t in (0.0, 10.0)]
    res = simulate(trace, 1, "affinity", MODEL)
    assert res.hit_rate == pytest.approx(32 / 128)
    assert res.oracle_hit_rate == pytest.approx(32 / 128)


def _one_request(prompt_tokens: int, model: EngineModel) -> float:
    from rayattn.bench.simulate import SimRequest

    blocks = prompt_tokens // model.block_size
    trace = [SimRequest(0.0, list(range(1, blocks + 1)), prompt_tokens,
                        list(range(1, blocks + 2)), 2, "s")]
    return simulate(trace, 1, "round_robin", model).ttft_p50_s


def test_a_steps_fixed_part_runs_under_its_compute_as_far_as_step_overlap_says():
    # Every step reads the weights once (itl_base_s) and computes its tokens. Overlapped
    # fully (a roofline), a short prompt rides on the weights' read for free and a long one
    # is bound by its compute; not at all, the two add up.
    roofline = EngineModel(prefill_s_per_token=1e-3, ctx_s_per_token=0.0, itl_base_s=0.05,
                           itl_per_seq_s=0.0, capacity_blocks=600, block_size=32,
                           step_overlap=1.0)
    assert _one_request(32, roofline) == pytest.approx(0.05)
    assert _one_request(320, roofline) == pytest.approx(0.32)
    assert _one_request(32, replace(roofline, step_overlap=0.0)) == pytest.approx(0.082)
    assert _one_request(32, replace(roofline, step_overlap=0.5)) == pytest.approx(0.066)


def _bursts(pairs: int) -> list:
    """Two groups whose prompts arrive in pairs at the same instant, group a first."""
    from rayattn.bench.simulate import SimRequest

    trace = []
    for k in range(pairs):
        for g, base in (("a", 100), ("b", 200)):
            keys = [base, base + 1, 1000 * base + k]
            trace.append(SimRequest(float(k), keys, 96, keys + [7 + k], 2, f"{g}{k}"))
    return trace


def test_the_routers_own_time_decides_which_request_of_a_burst_goes_first():
    # round_robin over two replicas sends a burst's first request to one and its second to
    # the other. Without the router's time, list order always puts group a on one replica
    # and group b on the other (every shared prefix found); with it, the order within a
    # burst is the renderer's, so groups spill over, the same way for the same seed.
    trace = _bursts(12)
    instant = simulate(trace, 2, "round_robin", MODEL)
    assert instant.hit_rate == pytest.approx(instant.oracle_hit_rate)
    timed = replace(MODEL, router_s=0.002)
    runs = [simulate(trace, 2, "round_robin", timed, seed=k) for k in range(4)]
    assert all(r.hit_rate < r.oracle_hit_rate - 0.05 for r in runs)
    again = simulate(trace, 2, "round_robin", timed, seed=0)
    assert (again.hit_rate, again.per_replica) == (runs[0].hit_rate, runs[0].per_replica)
    # The router's time is part of every first token.
    assert runs[0].ttft_p50_s > instant.ttft_p50_s


def test_the_fit_measures_the_routers_time_and_leaves_it_out_of_the_hop():
    from rayattn.bench.driver import Result
    from rayattn.bench.fit import fit_engine_model

    results = [Result(f"s{i}", 0, 256, 128, 8, ttft_s=0.30, e2e_s=0.5, replica="e0",
                      path="extend", reason="", status=200, start_s=float(i),
                      engine_ttft_s=0.25, engine_prefill_s=0.2, engine_queue_s=0.0,
                      engine_itl_s=0.02, router_s=0.01 + 0.002 * (i % 3))
               for i in range(12)]
    fitted = fit_engine_model(results, MODEL)
    assert fitted.router_s == pytest.approx(0.012)
    assert fitted.hop_s == pytest.approx(0.05 - 0.012)


def test_engines_that_share_a_host_slow_each_other_down():
    # Two engines on one host's cores: a step runs (1 + contention) times as long while the
    # other engine has work too, and at its own speed while the other is idle.
    from rayattn.bench.simulate import SimRequest

    model = EngineModel(prefill_s_per_token=1e-3, ctx_s_per_token=0.0, itl_base_s=0.05,
                        itl_per_seq_s=0.0, capacity_blocks=600, block_size=32,
                        step_overlap=1.0, contention=0.5)
    alone = [SimRequest(0.0, [1], 320, [1, 2], 2, "a")]
    assert simulate(alone, 2, "round_robin", model).ttft_p50_s == pytest.approx(0.32)
    together = alone + [SimRequest(0.0, [3], 320, [3, 4], 2, "b")]
    both = simulate(together, 2, "round_robin", model)
    assert both.per_replica == {"engine-0": 1, "engine-1": 1}
    assert both.ttft_p50_s == pytest.approx(0.48)
    assert simulate(together, 2, "round_robin", replace(model, contention=0.0)).ttft_p50_s \
        == pytest.approx(0.32)


def test_a_decode_costs_its_fixed_part_only_whatever_the_overlap():
    # A decode's own cost is itl_per_seq_s; the compute part counts prompt tokens. With
    # step_overlap 0 that is the additive model the GPU coefficients were fitted with.
    from rayattn.bench.simulate import SimRequest

    for overlap in (0.0, 1.0):
        model = EngineModel(prefill_s_per_token=1e-3, ctx_s_per_token=0.0, itl_base_s=0.05,
                            itl_per_seq_s=0.004, capacity_blocks=600, block_size=32,
                            step_overlap=overlap)
        res = simulate([SimRequest(0.0, [1], 32, [1, 2], 4, "a")], 1, "round_robin", model)
        assert res.engine_itl_p50_s == pytest.approx(0.054)


def test_the_routers_time_is_part_of_the_first_token_not_of_the_engines():
    import random

    from rayattn.bench.simulate import SimRequest

    model = EngineModel(prefill_s_per_token=1e-3, ctx_s_per_token=0.0, itl_base_s=0.05,
                        itl_per_seq_s=0.0, capacity_blocks=600, block_size=32,
                        step_overlap=1.0, router_s=0.01)
    res = simulate([SimRequest(0.0, [1], 320, [1, 2], 2, "a")], 1, "round_robin", model,
                   seed=3)
    drawn = random.Random("router/3").expovariate(1 / 0.01)
    assert res.engine_ttft_p50_s == pytest.approx(0.32)
    assert res.ttft_p50_s == pytest.approx(0.32 + drawn)


def test_contention_counts_only_the_engines_of_ones_host():
    from rayattn.bench.simulate import SimRequest

    model = EngineModel(prefill_s_per_token=1e-3, ctx_s_per_token=0.0, itl_base_s=0.05,
                        itl_per_seq_s=0.0, capacity_blocks=600, block_size=32,
                        step_overlap=1.0, contention=0.5, engines_per_host=2)
    burst = [SimRequest(0.0, [k], 320, [k, 100 + k], 2, f"s{k}") for k in (1, 2, 3)]
    res = simulate(burst[:2], 4, "round_robin", model)  # engine-0 and engine-1: one host
    assert res.ttft_p50_s == pytest.approx(0.48) and res.ttft_p90_s == pytest.approx(0.48)
    apart = simulate(burst[:2], 4, "round_robin", replace(model, engines_per_host=1))
    assert apart.ttft_p90_s == pytest.approx(0.32)
    # A short request on engine-0, done long before two more reach engine-1 and engine-2:
    # those two are on different hosts (engine-1's partner is idle), so neither slows.
    later = [SimRequest(0.0, [9], 32, [9, 10], 1, "short")] + [
        SimRequest(1.0, [k], 320, [k, 100 + k], 2, f"s{k}") for k in (1, 2)]
    res = simulate(later, 4, "round_robin", model)
    assert res.per_replica == {"engine-0": 1, "engine-1": 1, "engine-2": 1}
    assert res.ttft_p90_s == pytest.approx(0.32)


def test_engine_model_refuses_values_out_of_range():
    with pytest.raises(ValueError, match="step_overlap"):
        EngineModel(step_overlap=1.5)
    with pytest.raises(ValueError, match="contention"):
        EngineModel(contention=-0.1)


def test_calibration_finds_engines_that_share_a_host():
    # Real-run targets made by a known model (two engines slowing each other down); the
    # calibration starts from the least-squares kind of guess (independent engines, the
    # times off by 2x) and must land near the truth, contention included.
    from rayattn.bench.fit import Case, calibrate

    truth = EngineModel(prefill_s_per_token=1e-3, ctx_s_per_token=1e-5, itl_base_s=0.04,
                        itl_per_seq_s=1e-4, capacity_blocks=600, block_size=32,
                        step_overlap=1.0, contention=0.5, engines_per_host=2)
    tr = multi_turn_trace(conversations=8, turns=3, shared_systems=2, system_tokens=256,
                          user_tokens=64, output_tokens=8, rate=100, seed=6)
    real = simulate(tr, 2, "affinity", truth, index="events", concurrency=4)
    case = Case(tr, 4, 2, real.engine_ttft_p50_s, real.engine_ttft_p90_s,
                real.engine_prefill_p50_s, real.engine_itl_p50_s, real.sim_wall_s)
    guess = replace(truth, contention=0.0, engines_per_host=0, itl_base_s=0.08,
                    prefill_s_per_token=5e-4)
    fitted = calibrate([case], guess, rounds=4)
    assert fitted.contention > 0.2
    again = simulate(tr, 2, "affinity", fitted, index="events", concurrency=4)
    assert again.engine_ttft_p50_s == pytest.approx(real.engine_ttft_p50_s, rel=0.15)
    assert again.sim_wall_s == pytest.approx(real.sim_wall_s, rel=0.15)


def test_the_simulate_command_takes_the_engine_flags(tmp_path):
    import json

    from rayattn.cli import main

    args = ["simulate", "--replicas", "2", "--requests", "40", "--workload", "multi_turn",
            "--groups", "2", "--rate", "20", "--policies", "affinity", "--index", "events",
            "--out", str(tmp_path)]
    assert main(args + ["--contention", "0.3", "--engines-per-host", "2",
                        "--router-s", "0.004"]) == 0
    saved = json.loads((tmp_path / "sim_multi_turn_2r.json").read_text())
    assert saved["args"]["contention"] == 0.3 and saved["args"]["engines_per_host"] == 2
    assert saved["rows"][0]["requests"] == 40
    with pytest.raises(SystemExit, match="step_overlap"):
        main(args + ["--step-overlap", "2"])
