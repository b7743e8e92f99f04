"""rayattn.server.router_scaling: routers for the routers' CPU, run inside Serve's own
wrapper (bounds, delays) with Serve's AutoscalingContext."""

from __future__ import annotations

import time

from rayattn.server.cpu_meter import CpuMeter
from rayattn.server.router_scaling import METRIC, RoutersForCpu, routers_for


def test_routers_carry_the_summed_cpu_at_the_target():
    assert routers_for([0.9], 0.6, 1) == 2
    assert routers_for([0.6, 0.6], 0.6, 2) == 2        # exactly at target: no change
    assert routers_for([0.1, 0.05, 0.0, 0.0], 0.6, 4) == 1
    assert routers_for([], 0.6, 3) == 3                 # nothing reported yet: stay
    # One of three just started and has not reported: it carries the mean too.
    assert routers_for([0.9, 0.9], 0.6, 3) == 5


def _ctx(cpu: dict, current: int, lo: int = 1, hi: int = 8, state: dict | None = None,
         delay_s: float = 0):
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    dep = DeploymentID(name="router", app_name="rayattn")
    ids = {ReplicaID(unique_id=k, deployment_id=dep): v for k, v in cpu.items()}
    config = AutoscalingConfig(min_replicas=lo, max_replicas=hi, upscale_delay_s=delay_s,
                               downscale_delay_s=delay_s, look_back_period_s=15)
    return AutoscalingContext(
        deployment_id=dep, deployment_name="router", app_name="rayattn",
        current_num_replicas=current, target_num_replicas=current,
        running_replicas=list(ids), total_num_requests=0, total_queued_requests=0,
        aggregated_metrics={METRIC: ids}, raw_metrics={}, capacity_adjusted_min_replicas=lo,
        capacity_adjusted_max_replicas=hi, policy_state=state or {}, last_scale_up_time=None,
        last_scale_down_time=None, current_time=time.time(), config=config)


def test_serve_applies_the_tiers_delays_around_the_policy():
    """Serve's wrapper of a custom policy (the one its controller applies), then its bounds."""
    from ray.serve.autoscaling_policy import _apply_autoscaling_config

    policy = _apply_autoscaling_config(RoutersForCpu(target_cpu=0.5))
    up, _ = policy(_ctx({"a": 0.95, "b": 0.9}, current=2))
    assert up == 4
    down, _ = policy(_ctx({"a": 0.01, "b": 0.0, "c": 0.0}, current=3))
    assert down == 1
    # With a delay, the first tick that asks for more keeps the count and starts the clock.
    held, state = policy(_ctx({"a": 0.95, "b": 0.9}, current=2, delay_s=30))
    assert held == 2 and state["__decision_timestamp"] is not None


def test_the_cpu_meter_reads_cores_since_the_last_reading():
    cpu, clock = [10.0], [100.0]
    meter = CpuMeter(lambda: cpu[0], lambda: clock[0])
    cpu[0], clock[0] = 11.5, 102.0
    assert meter.read() == 0.75
    cpu[0], clock[0] = 11.5, 104.0
    assert meter.read() == 0.0
    assert meter.read() == 0.0  # no time passed
    real = CpuMeter()
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    assert real.read() > 0  # the CPU burned shows, however busy the machine
