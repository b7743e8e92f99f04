"""What an engine replica tells Serve's autoscaler about its load (`record_autoscaling_stats`,
read by rayattn/engine/scaling_policy.py): its KV cache usage and the 90th percentiles of the
time to first token and of the inter-token latency, each over the time since Serve last
asked (every few seconds). They come from vLLM's own per-iteration statistics, through a stat
logger (vLLM ships them from the engine core with the outputs it already sends)."""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterable
from typing import Any

from rayattn.engine.scaling_policy import SIGNALS

log = logging.getLogger("rayattn.engine")

TTFT, ITL, KV = SIGNALS
SAMPLES = 4096
"""Latency samples kept between two reports: a uniform sample of them all (reservoir), so
memory stays bounded however many tokens a busy engine makes, or where nobody asks."""
MIN_SAMPLES = 10
"""Fewer latencies than this since the last report give no percentile: one slow request is
not the fleet's p90."""


def p90(values: Iterable[float]) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


class Reservoir:
    """A uniform sample of at most `size` of the values offered since the last `take`."""

    def __init__(self, size: int = SAMPLES, rng: random.Random | None = None) -> None:
        self.size, self.rng = size, rng or random.Random(0)
        self.values: list[float] = []
        self.seen = 0

    def offer(self, values: Iterable[float]) -> None:
        for v in values:
            self.seen += 1
            if len(self.values) < self.size:
                self.values.append(v)
            elif (j := self.rng.randrange(self.seen)) < self.size:
                self.values[j] = v

    def take(self) -> tuple[list[float], int]:
        """The sample and how many values it stands for; empty again."""
        out, seen = self.values, self.seen
        self.values, self.seen = [], 0
        return out, seen


class LoadSignals:
    """Readings since the last report. An engine that ran no step since then used no KV
    (0.0); a latency with fewer than MIN_SAMPLES requests or tokens behind it is left out
    (little traffic is no latency pressure)."""

    def __init__(self) -> None:
        self._kv_sum, self._kv_n = 0.0, 0
        self._latency = {TTFT: Reservoir(), ITL: Reservoir()}

    def record(self, kv_usage: float | None, ttfts: Iterable[float],
               itls: Iterable[float]) -> None:
        if kv_usage is not None:
            self._kv_sum += kv_usage
            self._kv_n += 1
        self._latency[TTFT].offer(ttfts)
        self._latency[ITL].offer(itls)

    def read(self) -> dict[str, float]:
        """The report (metric names as scaling_policy.SIGNALS), and a fresh start."""
        out = {KV: self._kv_sum / self._kv_n if self._kv_n else 0.0}
        self._kv_sum, self._kv_n = 0.0, 0
        for name, reservoir in self._latency.items():
            sample, seen = reservoir.take()
            if seen >= MIN_SAMPLES:
                out[name] = p90(sample)
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
