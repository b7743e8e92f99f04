"""bench/autoscale_ramp.py's pure parts: the Serve config each policy deploys (real or
simulated engines, any shipped config) and a run's summary."""

from __future__ import annotations

import argparse

import pytest

from bench.autoscale_ramp import peak_spans, serve_config, summarize, wanted
from rayattn.config.loader import rayattn_apps
from tests.conftest import ROOT


def ramp_args(**over: object) -> argparse.Namespace:
    """The bench's own defaults (its parser), with `over` in place."""
    a = {"config": str(ROOT / "deployments" / "local.yaml"), "real_engines": False,
         "model": None, "set": [], "port": 8000, "engines": "1,3", "ttft_target_s": 1.5,
         "step_ms": 8.0, "prefill_us_per_token": 1000.0, "decode_us_per_seq": 300.0,
         "max_tokens": 16, "phases_s": "30,30,30"}
    return argparse.Namespace(**{**a, **over})


def test_a_gpu_config_is_served_with_its_own_engines_autoscaled_by_the_policy() -> None:
    a = ramp_args(config=str(ROOT / "deployments" / "h200.yaml"), real_engines=True,
                  model="/models/llama", engines="1,2",
                  set=["engine.max_num_seqs=16", "engine.env={A: '1'}"])
    cfg = serve_config(a, "ttft:0.7@warm_engines=false")
    [(_, app)] = rayattn_apps(cfg)  # what `serve run` would read, validated
    assert app.engine.simulated is None
    assert app.model.source == "/models/llama"
    assert (app.engine.max_num_seqs, app.engine.env) == (16, {"A": "1"})
    auto = app.serve.engine_autoscaling
    assert (auto.min_replicas, auto.max_replicas, auto.ttft_p90_s) == (1, 2, 0.7)
    assert app.router.warm_engines is False
    # h200.yaml fixes two engines; the autoscaler owns the count instead.
    assert app.parallelism.data_parallel_size == 1


def test_the_default_config_runs_simulated_engines_on_serves_own_policy() -> None:
    [(_, app)] = rayattn_apps(serve_config(ramp_args(), "ongoing:4"))
    assert app.engine.simulated is not None
    auto = app.serve.engine_autoscaling
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (1, 3, 4)
    assert auto.targets == {}


def test_a_bad_override_fails_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        rayattn_apps(serve_config(ramp_args(set=["engine.max_num_seqs=-1"]), "ongoing:2"))


def test_later_turns_hit_is_counted_against_their_own_history() -> None:
    def turn(t: float, n: int, prompt: int, cached: int, oracle: int, moved: bool) -> dict:
        return {"t": t, "turn": n, "status": 200, "ttft_s": 0.1, "prompt": prompt,
                "cached": cached, "replica": "r", "moved": moved, "oracle": oracle}

    results = [turn(1, 0, 300, 0, 0, False),
               turn(5, 1, 400, 288, 320, False),   # 320 of its history in whole blocks
               turn(9, 2, 500, 0, 416, True)]      # moved to a cold engine: nothing cached
    s = summarize(results, [(0.0, 1, 1), (90.0, 1, 1)], ramp_args())
    assert s["later_hit_vs_history"] == round(288 / (320 + 416), 3)
    assert s["later_cached_share"] == round(288 / 900, 3)
    assert (s["moved_turns"], s["moved_cached_share"]) == (1, 0.0)
    assert s["failed"] == 0


def test_the_ramp_steps_or_rises_in_a_straight_line() -> None:
    phases = [30.0, 180.0, 60.0]
    assert [wanted(t, phases, 16, 160) for t in (0, 29.9, 30, 209.9, 210, 269.9, 270)] == \
        [16, 16, 160, 160, 16, 16, 0]
    # A 60-s rise: half way up at 60 s, the peak from 90 s; down the same way after 210 s.
    assert [wanted(t, phases, 16, 160, 60) for t in (30, 60, 90, 209.9, 240, 270)] == \
        [16, 88, 160, 160, 88, 0]
    # A rise longer than a phase takes the phase.
    assert wanted(45, [30.0, 30.0, 30.0], 0, 100, 600) == 50
    # A second peak: the same rise again after the quiet.
    two = [30.0, 60.0, 60.0, 60.0, 30.0]
    assert [wanted(t, two, 10, 100, 20) for t in (20, 40, 100, 160, 170, 190, 215, 240)] == \
        [10, 55, 55, 55, 100, 100, 78, 0]
    assert peak_spans(two) == [(30.0, 90.0), (150.0, 210.0)]


def test_a_minute_is_judged_by_its_own_p90() -> None:
    def req(t: float, ttft: float) -> dict:
        return {"t": t, "turn": 0, "status": 200, "ttft_s": ttft, "prompt": 10, "cached": 0,
                "replica": "r", "moved": False, "oracle": 0}

    # Minute 0: one slow request in twenty, within target at its p90 though one of its
    # 10-s windows (the slow one's alone) is not; minute 1: all slow; minute 2: idle.
    first = [req(t, 0.1) for t in range(12, 60, 3)] + [req(2, 5.0)]
    results = first + [req(60 + t, 2.0) for t in range(0, 60, 5)]
    s = summarize(results, [(0.0, 1, 1), (180.0, 1, 1)],
                  ramp_args(phases_s="60,60,60", ttft_target_s=1.0))
    assert s["minutes_within_target"] == "1/2"
    assert s["windows_within_target"] == "5/12"
