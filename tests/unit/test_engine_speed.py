"""The engine's measured speed, which routers adopt as their cost model."""

from __future__ import annotations

from rayattn.engine.replica import EngineSpeed


def test_engine_speed_is_measured_per_token_and_per_running_sequence():
    s = EngineSpeed(alpha=0.5)
    assert s.report() == {"prefill_s_per_token": None, "decode_s_per_seq": None}
    s.observe(1000, {"prefill_s": 2.0, "itl_s": 0.08}, running=4)
    assert s.report() == {"prefill_s_per_token": 0.002, "decode_s_per_seq": 0.02}
    s.observe(1000, {"prefill_s": 1.0, "itl_s": None}, running=4)  # EWMA, no decode sample
    assert s.report() == {"prefill_s_per_token": 0.0015, "decode_s_per_seq": 0.02}
    s.observe(10, {"prefill_s": 5.0}, running=1)  # too few tokens to say anything
    assert s.report()["prefill_s_per_token"] == 0.0015
