"""What an engine replica tells Serve's autoscaler about its load (`record_autoscaling_stats`,
read by rayattn/engine/scaling_policy.py): its KV cache usage and the 90th percentiles of the
time to first token and of the inter-token latency, each over the time since the previous
report. They come from vLLM's own per-iteration statistics, through a stat logger (vLLM
ships them from the engine core with the outputs it already sends)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import Any

MAX_SAMPLES = 20_000
"""Latency samples kept between two reports (the newest): a bound on memory where nobody
reads them (an engine deployment Serve does not autoscale)."""


def p90(values: Iterable[float]) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


class LoadSignals:
    """Readings since the last report. An engine that ran no step since then used no KV
    (0.0); a latency with no request behind it is left out (no traffic is no pressure)."""

    def __init__(self) -> None:
        self._kv_sum, self._kv_n = 0.0, 0
        self._ttft: deque[float] = deque(maxlen=MAX_SAMPLES)
        self._itl: deque[float] = deque(maxlen=MAX_SAMPLES)

    def record(self, kv_usage: float | None, ttfts: Iterable[float],
               itls: Iterable[float]) -> None:
        if kv_usage is not None:
            self._kv_sum += kv_usage
            self._kv_n += 1
        self._ttft.extend(ttfts)
        self._itl.extend(itls)

    def read(self) -> dict[str, float]:
        """The report (metric names as scaling_policy.SIGNALS), and a fresh start."""
        out = {"kv_usage": self._kv_sum / self._kv_n if self._kv_n else 0.0}
        for name, samples in (("ttft_p90_s", self._ttft), ("itl_p90_s", self._itl)):
            value = p90(samples)
            if value is not None:
                out[name] = value
        self._kv_sum, self._kv_n = 0.0, 0
        self._ttft.clear()
        self._itl.clear()
        return out


def make_signals_logger_factory(signals: LoadSignals) -> Any:
    """A vLLM stat logger feeding `signals` (with DP ranks, every rank's readings)."""
    # vLLM: only the engine replica builds the logger.
    from vllm.v1.metrics.loggers import StatLoggerBase

    class LoadSignalsLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any,
                   mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
            try:
                signals.record(
                    getattr(scheduler_stats, "kv_cache_usage", None),
                    getattr(iteration_stats, "time_to_first_tokens_iter", ()) or (),
                    getattr(iteration_stats, "inter_token_latencies_iter", ()) or ())
            except Exception:  # a failing stat logger would take vLLM's output loop down
                pass

        def log(self) -> None:
            pass

        def log_engine_initialized(self) -> None:
            pass

    return LoadSignalsLogger
