"""The applications of their own that the last integration tests run on, deployed side by side
in place of the shared one (one wait for all, their engines starting together):
deployments/local-multi.yaml's, local.yaml's app as one engine replica running two DP ranks,
and local.yaml's app with two simulated engines (engine.simulated), each on a route prefix of
its own."""

from __future__ import annotations

import copy
import threading
from typing import Any

import yaml

MULTI_APP = "rayattn-multi"  # deployments/local-multi.yaml's
DP_APP = "rayattn-dp"
SIM_APP = "rayattn-sim"
SIMULATED = {"step_ms": 5.0, "prefill_us_per_token": 20.0, "decode_us_per_seq": 40.0,
             "num_blocks": 4096, "max_tokens": 8}
"""The simulated engines' settings (engine.simulated) in SIM_APP."""
SIM_KV_TARGET = 0.01
"""SIM_APP's engines autoscale (2..3) on KV usage alone, at this target (41 of 4096 blocks:
one request of a long prompt running over it); requests in flight never ask for more."""
SIM_AUTOSCALING = {"min_replicas": 2, "max_replicas": 3, "target_ongoing_requests": 1000,
                   "upscale_delay_s": 1, "downscale_delay_s": 4, "look_back_period_s": 3,
                   "metrics_interval_s": 1, "policy": {
                       "policy_function": "rayattn.engine.scaling_policy:EnginesForTargets",
                       "policy_kwargs": {"kv_usage": SIM_KV_TARGET}}}


class Collector:
    """A local OTLP/HTTP traces receiver: the spans every export carried."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        self.spans: list = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                for rs in req.resource_spans:
                    for ss in rs.scope_spans:
                        outer.spans.extend(ss.spans)
                out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args) -> None:
                pass

        # Port 0: the server keeps the port the kernel gave it (no choose-then-bind race).
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str) -> dict:
        return {s.name: s for s in self.spans if s.trace_id.hex() == trace_id}


def own_apps_config(multi_file: str, local: dict[str, Any], otlp_url: str) -> dict[str, Any]:
    """One Serve config of the three applications. The multi-model app's traces go to the
    test's own receiver (tracing is off in the shipped file). The DP-ranks app is local.yaml's
    with `parallelism.engine_dp_size: 2` and one engine replica (one reservation of
    `cpus_per_engine` for both ranks); the simulated engines reserve hundredths of a CPU and
    autoscale on their KV usage (SIM_AUTOSCALING)."""
    multi = yaml.safe_load(multi_file)
    assert multi["applications"][0]["name"] == MULTI_APP
    multi["applications"][0]["args"]["tracing"] = {"otlp_endpoint": otlp_url}
    sim = copy.deepcopy(local["applications"][0])
    dp = local["applications"][0]
    dp.update(name=DP_APP, route_prefix="/dp")
    dp["args"]["parallelism"] = {"engine_dp_size": 2}
    # local-multi's three engines and this one take the 2 CPUs the shared app's Ray has, but
    # for what the simulated engines reserve (a reservation, not a pin).
    dp["args"]["platform"]["cpus_per_engine"] = 0.45
    for d in dp["deployments"]:
        if d["name"] == "engine":
            d["autoscaling_config"].update(min_replicas=1, max_replicas=1)
    # Simulated engines hold next to no CPU: the app fits beside the others.
    sim.update(name=SIM_APP, route_prefix="/sim")
    sim["args"]["platform"]["cpus_per_engine"] = 0.01
    sim["args"]["engine"]["simulated"] = SIMULATED
    for d in sim["deployments"]:
        if d["name"] == "engine":
            d["autoscaling_config"] = SIM_AUTOSCALING
    return {**multi, "applications": [*multi["applications"], dp, sim]}
