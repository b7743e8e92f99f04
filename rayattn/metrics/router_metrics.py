"""Router-side metrics: decisions by reason, predicted vs actual cached tokens (the drift the
index makes), in-flight load per replica and fleet imbalance, cache-pressure admission (its
fill per engine, requests waiting for KV room), retries and failures."""

from __future__ import annotations

from ray.util import metrics as rm

from rayattn.metrics.engine_metrics import LATENCY_BUCKETS
from rayattn.routing.policies import Decision

# Absolute token error; the `direction` label says whether the router over- or
# under-predicted (Ray histograms take positive boundaries only).
DRIFT_BUCKETS = [1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 16384]


class RouterMetrics:
    def __init__(self, model: str, policy: str) -> None:
        self.base = {"model": model, "policy": policy}
        keys = ("model", "policy")
        self.decisions = rm.Counter("rayattn_router_decisions_total",
                                    "Routing decisions by reason", tag_keys=(*keys, "reason",
                                                                             "target"))
        self.drift = rm.Histogram("rayattn_router_cached_tokens_drift",
                                  "|engine-reported - router-predicted| cached tokens",
                                  boundaries=DRIFT_BUCKETS, tag_keys=(*keys, "direction"))
        self.predicted = rm.Counter("rayattn_router_predicted_cached_tokens_total",
                                    "Cached tokens the router predicted", tag_keys=keys)
        self.predicted_reload = rm.Counter(
            "rayattn_router_predicted_reload_tokens_total",
            "Of the cached tokens the router predicted, those it expected the engine to "
            "reload from its host-memory KV tier", tag_keys=keys)
        self.index_blocks = rm.Gauge(
            "rayattn_router_index_blocks",
            "KV blocks the router's index holds for each replica, by tier (gpu: the "
            "engine's own cache; cpu: its host-memory tier)", tag_keys=(*keys, "target", "tier"))
        self.actual = rm.Counter("rayattn_router_actual_cached_tokens_total",
                                 "Cached tokens engines reported", tag_keys=keys)
        self.prompt = rm.Counter("rayattn_router_prompt_tokens_total",
                                 "Prompt tokens routed", tag_keys=keys)
        self.inflight = rm.Gauge("rayattn_router_inflight", "In-flight requests per replica",
                                 tag_keys=(*keys, "target"))
        self.kv_waiting = rm.Gauge(
            "rayattn_router_kv_waiting",
            "Requests waiting in the router for KV room (cache-pressure admission)",
            tag_keys=keys)
        self.admission_fill = rm.Gauge(
            "rayattn_router_admission_fill",
            "The share of each engine's KV cache cache-pressure admission admits up to from "
            "this router (its fill times this router's share of the cache)",
            tag_keys=(*keys, "target"))
        self.imbalance = rm.Gauge("rayattn_router_imbalance",
                                  "max/mean in-flight requests across live replicas",
                                  tag_keys=keys)
        self.replicas_up = rm.Gauge("rayattn_router_replicas_up", "Live engine replicas",
                                    tag_keys=keys)
        self.replicas = rm.Gauge("rayattn_router_replicas",
                                 "Engine replicas Serve runs (up or not)", tag_keys=keys)
        self.retries = rm.Counter("rayattn_router_retries_total",
                                  "Requests retried on another replica", tag_keys=keys)
        self.failures = rm.Counter("rayattn_router_failures_total",
                                   "Requests that failed, by cause", tag_keys=(*keys, "cause"))
        self.rejected = rm.Counter("rayattn_router_rejected_total",
                                   "Requests rejected (4xx/429/503) by status",
                                   tag_keys=(*keys, "status"))
        self.regret = rm.Counter(
            "rayattn_router_regret_tokens_total",
            "Prompt tokens sent to be recomputed on one replica while another held them "
            "cached when the decision was made, by decision reason", tag_keys=(*keys, "reason"))
        self.moves = rm.Counter(
            "rayattn_router_session_moves_total",
            "Conversations routed elsewhere than their previous turn, by decision reason",
            tag_keys=(*keys, "reason"))
        self.warm_tokens = rm.Counter(
            "rayattn_router_warm_tokens_total",
            "Tokens prefilled on engines that join (shared prefixes: why=join) or for the "
            "conversations of engines that leave (why=move)", tag_keys=(*keys, "why"))
        self.e2e = rm.Histogram("rayattn_router_request_seconds",
                                "Request latency seen by the router", boundaries=LATENCY_BUCKETS,
                                tag_keys=keys)

    def set_policy(self, policy: str) -> None:
        """Label what follows with the policy now routing (a live change, a benchmark's
        switch)."""
        self.base = {**self.base, "policy": policy}

    def decision(self, d: Decision) -> None:
        """One routing decision (a routing.policies.Decision): its reason and target, and
        the router's regret in it (tokens another replica held, a conversation moved)."""
        self.decisions.inc(1, {**self.base, "reason": d.reason, "target": d.replica})
        if d.regret_tokens > 0:
            self.regret.inc(d.regret_tokens, {**self.base, "reason": d.reason})
        if d.moved_from is not None:
            self.moves.inc(1, {**self.base, "reason": d.reason})

    def outcome(self, predicted: int, actual: int, prompt: int, seconds: float,
                reload: int = 0) -> None:
        diff = actual - predicted
        direction = "exact" if diff == 0 else ("under" if diff > 0 else "over")
        self.drift.observe(abs(diff), {**self.base, "direction": direction})
        for counter, value in ((self.predicted, predicted), (self.actual, actual),
                               (self.prompt, prompt), (self.predicted_reload, reload)):
            if value > 0:  # Ray counters reject increments of 0
                counter.inc(value, self.base)
        self.e2e.observe(seconds, self.base)

    def load(self, inflight: dict[str, int], replicas: list[str], imbalance: float,
             up: int, members: int, blocks: dict[str, tuple[int, int]] | None = None,
             fills: dict[str, float] | None = None, kv_waiting: int = 0) -> None:
        """`replicas`: the live routing targets (engine replicas, or DP ranks of one);
        `up` / `members`: engine replicas up / in the deployment; `blocks`: per target, the
        index's (gpu, cpu) tier blocks; `fills`: per target, cache-pressure admission's
        fill of this router's share (None: admission off); `kv_waiting`: requests held for
        KV room now."""
        for r in replicas:
            self.inflight.set(inflight.get(r, 0), {**self.base, "target": r})
            gpu, cpu = (blocks or {}).get(r, (0, 0))
            self.index_blocks.set(gpu, {**self.base, "target": r, "tier": "gpu"})
            self.index_blocks.set(cpu, {**self.base, "target": r, "tier": "cpu"})
            if fills is not None:
                self.admission_fill.set(fills.get(r, 0.0), {**self.base, "target": r})
        self.kv_waiting.set(kv_waiting, self.base)
        self.imbalance.set(imbalance, self.base)
        self.replicas_up.set(up, self.base)
        self.replicas.set(members, self.base)

    def left(self, replica: str) -> None:
        # A replica that left (scale-down, update) keeps no stale in-flight value or blocks.
        self.inflight.set(0, {**self.base, "target": replica})
        self.admission_fill.set(0, {**self.base, "target": replica})
        for tier in ("gpu", "cpu"):
            self.index_blocks.set(0, {**self.base, "target": replica, "tier": tier})
