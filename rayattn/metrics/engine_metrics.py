"""Per-request and per-step metrics recorded inside an engine replica, split by attention
path, exported through Ray's metrics pipeline (names get Ray's `ray_` prefix on scrape).

Paths (vLLM's own batch split): a request's first chunk is `prefill` when nothing was cached
and `extend` when it attends to cached context; everything after the first token is `decode`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from ray.util import metrics as rm

# From a fast GPU's decode step (a millisecond) to minutes (CPU prefill of long prompts under
# load).
LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28,
                   2.56, 5.12, 10.24, 20.48, 40.96, 81.92, 163.84]
# dp_rank: the replica's rank among the engine replicas (rayattn's DP); engine_rank: the DP
# rank inside the replica's engine that ran a request (parallelism.dp_attention /
# engine_dp_size; 0 where it runs one; "" where vLLM's balancer picked it, unseen here).
TAGS = ("model", "backend", "replica", "dp_rank", "engine_rank")


class EngineMetrics:
    def __init__(self, model: str, backend: str, replica: str, dp_rank: int) -> None:
        self.tags = {"model": model, "backend": backend, "replica": replica,
                     "dp_rank": str(dp_rank), "engine_rank": "0"}
        # Per path and per LoRA adapter ("" for the base model).
        ptags = (*TAGS, "path", "adapter")
        H, C = rm.Histogram, rm.Counter
        self.ttft = H("rayattn_ttft_seconds", "Time to first token by attention path",
                      boundaries=LATENCY_BUCKETS, tag_keys=ptags)
        self.prefill = H("rayattn_prefill_seconds",
                         "Engine time from scheduling to first token, by path",
                         boundaries=LATENCY_BUCKETS, tag_keys=ptags)
        self.queue = H("rayattn_queue_seconds", "Time waiting for the scheduler",
                       boundaries=LATENCY_BUCKETS, tag_keys=ptags)
        self.itl = H("rayattn_decode_itl_seconds", "Mean inter-token latency of one request",
                     boundaries=LATENCY_BUCKETS, tag_keys=TAGS)
        self.e2e = H("rayattn_e2e_seconds", "Request latency in the engine replica",
                     boundaries=LATENCY_BUCKETS, tag_keys=ptags)
        self.tokens = C("rayattn_tokens_total",
                        "Tokens by path and kind (computed, cached, generated)",
                        tag_keys=(*ptags, "kind"))
        self.requests = C("rayattn_requests_total", "Finished requests by first-chunk path",
                          tag_keys=ptags)
        self.step_tokens = C("rayattn_step_tokens_total",
                             "Tokens scheduled per engine step, by batch part (context = "
                             "prefill+extend chunks, decode)", tag_keys=(*TAGS, "part"))
        self.step_seconds = C("rayattn_step_seconds_total",
                              "Engine step time attributed to batch parts by token share",
                              tag_keys=(*TAGS, "part"))
        self.steps = C("rayattn_steps_total",
                       "Engine steps by mix: decode_only, context_only, mixed",
                       tag_keys=(*TAGS, "mix"))
        self._step_acc: defaultdict[tuple[str, str, int], float] = defaultdict(float)
        self._last_flush = time.monotonic()
        self.info = rm.Gauge("rayattn_engine_info",
                             "1 per engine replica, labelled with its layout",
                             tag_keys=(*TAGS, "tp", "ep", "platform"))
        self.step_metrics_available = True
        """Set by rayattn.compat.step_metrics_kwargs: False where vLLM has no per-step details."""
        self.step_available = rm.Gauge("rayattn_step_metrics_available",
                                       "1 when the engine's vLLM ships per-step details (the "
                                       "rayattn_step_* series), 0 where it does not",
                                       tag_keys=TAGS)

    def record_request(self, path: str, prompt_tokens: int, cached: int, generated: int,
                       timings: dict[str, Any], adapter: str = "",
                       rank: int | None = 0) -> None:
        tags = self._ranked(rank)
        t = {**tags, "path": path, "adapter": adapter}
        self.ttft.observe(timings["ttft_s"], t)
        self.prefill.observe(timings["prefill_s"], t)
        self.queue.observe(timings["queue_s"], t)
        self.e2e.observe(timings["e2e_s"], t)
        self.requests.inc(1, t)
        _inc(self.tokens, prompt_tokens - cached, {**t, "kind": "computed"})
        _inc(self.tokens, cached, {**t, "kind": "cached"})
        _inc(self.tokens, generated, {**tags, "path": "decode", "adapter": adapter,
                                      "kind": "generated"})
        if generated > 1 and timings.get("itl_s") is not None:
            self.itl.observe(timings["itl_s"], tags)

    def _ranked(self, rank: int | None) -> dict[str, str]:
        if rank == 0:
            return self.tags
        return {**self.tags, "engine_rank": "" if rank is None else str(rank)}

    def record_step(self, ctx_tokens: int, dec_tokens: int, seconds: float,
                    rank: int = 0) -> None:
        """Called once per engine step: accumulate in plain Python and hand the totals to
        Ray's metrics at most once a second, so the per-step cost is a few additions."""
        total = ctx_tokens + dec_tokens
        if total == 0:
            return
        mix = "mixed" if ctx_tokens and dec_tokens else (
            "context_only" if ctx_tokens else "decode_only")
        acc = self._step_acc
        acc[("steps", mix, rank)] += 1
        for part, n in (("context", ctx_tokens), ("decode", dec_tokens)):
            if n:
                acc[("tokens", part, rank)] += n
                acc[("seconds", part, rank)] += seconds * n / total
        now = time.monotonic()
        if now - self._last_flush >= 1.0:
            self.flush_steps(now)

    def flush_steps(self, now: float | None = None) -> None:
        acc, self._step_acc = self._step_acc, defaultdict(float)
        self._last_flush = now or time.monotonic()
        for (what, label, rank), v in acc.items():
            tags = self._ranked(rank)
            if what == "steps":
                _inc(self.steps, v, {**tags, "mix": label})
            elif what == "tokens":
                _inc(self.step_tokens, v, {**tags, "part": label})
            else:
                _inc(self.step_seconds, v, {**tags, "part": label})


def _inc(counter: rm.Counter, value: float, tags: dict[str, str]) -> None:
    # Ray counters reject increments of 0.
    if value > 0:
        counter.inc(value, tags)


def make_step_logger_factory(metrics: EngineMetrics):
    """A vLLM stat logger that turns vLLM's per-iteration details (shipped from the engine
    core with the outputs it already sends, so no extra channel) into step-split metrics."""
    # vLLM: only the engine replica builds the logger; the router imports this module too.
    from vllm.v1.metrics.loggers import StatLoggerBase

    class PathStepLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            self.metrics = metrics

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
                   engine_idx: int = 0) -> None:
            d = getattr(scheduler_stats, "iteration_details", None) if scheduler_stats else None
            if d is not None and not d.is_dummy:
                try:
                    self.metrics.record_step(d.num_ctx_tokens, d.num_generation_tokens,
                                             d.elapsed_ms / 1000, engine_idx)
                except Exception:  # a failing stat logger would take vLLM's output loop down
                    pass

        def log(self) -> None:  # vLLM calls this every few seconds
            self.metrics.flush_steps()
            self.metrics.step_available.set(int(self.metrics.step_metrics_available),
                                            self.metrics.tags)

        def log_engine_initialized(self) -> None:
            pass

    return PathStepLogger
