"""What an engine replica tells Serve's autoscaler about its load (`record_autoscaling_stats`,
read by rayattn/engine/scaling_policy.py): its KV cache usage since Serve last asked (every
few seconds) and the 90th percentiles of the time to first token and of the inter-token
latency over the last WINDOW_S seconds. They come from vLLM's own per-iteration statistics,
through a stat logger (vLLM ships them from the engine core with the outputs it already
sends)."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable
from typing import Any

from rayattn.engine.scaling_policy import LATENCY_WINDOW_S, SAMPLES, SIGNALS

log = logging.getLogger("rayattn.engine")

TTFT, ITL, KV = SIGNALS
WINDOW_S = LATENCY_WINDOW_S
"""Latency percentiles cover the last this many seconds, however often Serve asks (every
couple of seconds with short look-back windows): at a few requests a second, one read's
worth would be too few to count."""
BUCKET_S = 1.0
PER_BUCKET = 512
"""Latencies kept per second of the window: a uniform sample of that second's (reservoir),
so memory stays bounded however many tokens a busy engine makes, or where nobody asks."""


class Reservoir:
    """A uniform sample of at most `size` of the values offered to it."""

    def __init__(self, size: int, rng: random.Random) -> None:
        self.size, self.rng = size, rng
        self.values: list[float] = []
        self.seen = 0

    def offer(self, v: float) -> None:
        self.seen += 1
        if len(self.values) < self.size:
            self.values.append(v)
        elif (j := self.rng.randrange(self.seen)) < self.size:
            self.values[j] = v


class WindowedLatency:
    """The latencies of the last WINDOW_S seconds, as per-second uniform samples."""

    def __init__(self, window_s: float = WINDOW_S, per_bucket: int = PER_BUCKET,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s, self.per_bucket, self.clock = window_s, per_bucket, clock
        self.rng = random.Random(0)
        self.buckets: dict[int, Reservoir] = {}

    def offer(self, values: Iterable[float]) -> None:
        now = int(self.clock() // BUCKET_S)
        bucket = None
        for v in values:
            if bucket is None:
                bucket = self.buckets.get(now)
                if bucket is None:
                    bucket = self.buckets[now] = Reservoir(self.per_bucket, self.rng)
                    self._expire(now)
            bucket.offer(v)

    def _expire(self, now: int) -> None:
        # Whole seconds: the window holds the last window_s to window_s + 1 seconds.
        oldest = now - int(self.window_s // BUCKET_S)
        for k in [k for k in self.buckets if k < oldest]:
            del self.buckets[k]

    def p90(self) -> tuple[float, int]:
        """The window's p90, each kept value weighing for the values its second saw, and how
        many values the window saw (0.0, 0 where none)."""
        self._expire(int(self.clock() // BUCKET_S))
        seen = sum(b.seen for b in self.buckets.values())
        if not seen:
            return 0.0, 0
        weighted = sorted((v, b.seen / len(b.values)) for b in self.buckets.values()
                          for v in b.values)
        total, acc = sum(w for _, w in weighted), 0.0
        for v, w in weighted:
            acc += w
            if acc >= 0.9 * total - 1e-9:
                return v, seen
        return weighted[-1][0], seen


class LoadSignals:
    """What the engine reports: KV usage since the last report (an engine that ran no step
    since then used no KV: 0.0) and each latency's p90 over the last WINDOW_S seconds with the
    count of requests or tokens behind it, every time (0.0 and 0 with none): a key left out
    would have Serve carry its last figure forward, and the policy weighs each engine's p90 by
    its count."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._kv_sum, self._kv_n = 0.0, 0
        self._latency = {TTFT: WindowedLatency(clock=clock), ITL: WindowedLatency(clock=clock)}

    def record(self, kv_usage: float | None, ttfts: Iterable[float],
               itls: Iterable[float]) -> None:
        if kv_usage is not None:
            self._kv_sum += kv_usage
            self._kv_n += 1
        self._latency[TTFT].offer(ttfts)
        self._latency[ITL].offer(itls)

    def read(self) -> dict[str, float]:
        """The report (metric names as scaling_policy.SIGNALS); KV usage starts afresh."""
        out = {KV: self._kv_sum / self._kv_n if self._kv_n else 0.0}
        self._kv_sum, self._kv_n = 0.0, 0
        for name, window in self._latency.items():
            out[name], out[SAMPLES[name]] = window.p90()
        return out


_FIELDS = ("time_to_first_tokens_iter", "inter_token_latencies_iter")


def make_signals_logger_factory(signals: LoadSignals) -> Any:
    """A vLLM stat logger feeding `signals` (with DP ranks, every rank's readings)."""
    # vLLM: only the engine replica builds the logger.
    from vllm.v1.metrics.loggers import StatLoggerBase

    class LoadSignalsLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.missing_said = self.failure_said = False

        def record(self, scheduler_stats: Any, iteration_stats: Any,
                   mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
            if iteration_stats is not None and not self.missing_said and not all(
                    hasattr(iteration_stats, f) for f in _FIELDS):
                # A vLLM that renamed them: the fleet would never scale on latency, quietly.
                self.missing_said = True
                log.warning("vLLM's IterationStats lacks %s: the engine reports no latency "
                            "to the autoscaler", [f for f in _FIELDS
                                                  if not hasattr(iteration_stats, f)])
            try:
                signals.record(
                    getattr(scheduler_stats, "kv_cache_usage", None),
                    getattr(iteration_stats, _FIELDS[0], ()) or (),
                    getattr(iteration_stats, _FIELDS[1], ()) or ())
            except Exception:  # a failing stat logger would take vLLM's output loop down
                if not self.failure_said:
                    self.failure_said = True
                    log.exception("load signals: readings are dropped")

        def log(self) -> None:
            pass

        def log_engine_initialized(self) -> None:
            pass

    return LoadSignalsLogger
