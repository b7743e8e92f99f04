"""Serve's autoscaling policy for the engine replicas: as many engines as the most pressed of
the user's targets asks for (serve.engine_autoscaling: requests in flight per engine, and
where set the time to first token, the inter-token latency and the KV cache usage).

Each target gives a pressure, what the engines report over what the target allows (1.0: on
target). Above 1 the fleet grows: in proportion to the highest pressure where that is
requests in flight or KV (they divide over the engines), by at most doubling where it is a
latency (latency does not divide: an unloaded prefill takes as long on any engine, and
queueing rises steeply near saturation), and not again until the latency shows the grown
fleet. Below `hold_band` of every target it shrinks, by at most half per decision, to as
many engines as keep the highest pressure at `hold_band`: for the signals that divide over
the engines the next decision then does not grow it back (no flapping). A latency does not
divide: queueing makes it steep near saturation, so two engines well under a TTFT target can
be one engine far over it. The policy therefore remembers what an engine carries at the
latency targets, as the fleet showed it over the last BREACH_MEMORY_S: the highest load per
engine (requests in the engines' latency window) at which a target broke, or the highest it
carried within every target where that is more (a target also breaks at loads an engine
carries: an opening burst, a backlog draining); it never shrinks to fewer engines than carry
the load now at `hold_band` of that. The same memory lets it grow before a target breaks
again: an engine takes a while to start (the policy times the fleet's own starts), and where
the load, projected that far ahead (and Serve's upscale delay) on its trend, reaches the
load per engine at which a target broke (when that was the most an engine was seen to
carry), the engines that load needs are started now. In between it holds the count Serve
aims for (replicas still starting included). A latency counts only with MIN_SAMPLES behind
it over the fleet, each engine's p90 weighted by its samples. Serve's controller runs it
every tick and applies the bounds and the upscale/downscale delays around it. The engines
report their signals through `record_autoscaling_stats` (rayattn/engine/load_signals.py).

Serve pickles this module by value into its controller: it imports nothing of rayattn."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

LATENCIES = ("ttft_p90_s", "itl_p90_s")
SIGNALS = (*LATENCIES, "kv_usage")
"""The metrics engines report, each named as the target that bounds it."""
SAMPLES = {"ttft_p90_s": "ttft_samples", "itl_p90_s": "itl_samples"}
"""Beside each latency, how many requests (TTFT) or tokens (ITL) its window held."""
ONGOING = "ongoing_requests"
"""The pressure of requests in flight per engine (Serve's own count)."""
LATENCY_GROWTH = 2.0
"""The most a latency pressure multiplies the fleet by in one decision."""
MIN_SAMPLES = 10
"""Fewer latencies than this over the fleet's windows make no signal: one slow request is
not a p90, and a fleet that grew must not lose its signal by spreading the same traffic."""
BREACH_MEMORY_S = 1800.0
"""How long what the fleet showed of an engine's capacity bounds a shrink (the workload, and
with it what an engine carries, changes over a day)."""
MAX_START_S = 600.0
"""A join longer than this after Serve's last decision is not that decision's engine (a
replacement, a controller that restarted): it times no start."""
LATENCY_WINDOW_S = 10.0
"""The engines' latency window (rayattn/engine/load_signals.py WINDOW_S): after a scale-up a
latency is this plus Serve's look-back old before it shows the larger fleet."""


def engines_for(current: int, target: int, pressures: Mapping[str, float],
                hold_band: float, floor: int = 1) -> int:
    """Engines for `pressures` (observed / target by signal): `current` running, `target`
    what Serve aims for now (more while replicas start, fewer while they drain); a shrink
    stops at `floor` (`load_floor`)."""
    if current <= 0 or not pressures:
        return target
    top = max(pressures.values())
    if top > 1.0:
        grow = max((min(v, LATENCY_GROWTH) if k in LATENCIES else v)
                   for k, v in pressures.items())
        return max(target, current + 1, math.ceil(current * grow - 1e-9))
    if top >= hold_band:
        return target
    # Never above the target either: Serve would count it as a scale-up.
    return min(target, max(1, floor, math.ceil(current / 2),
                           math.ceil(current * top / hold_band - 1e-9)))


def load_floor(load: float, full_per_engine: float | None, hold_band: float) -> int:
    """The fewest engines that carry `load` at `hold_band` of what one engine carries at
    the latency targets (`EngineCapacity`; 1 where that is unknown)."""
    if not full_per_engine or load <= 0:
        return 1
    return max(1, math.ceil(load / (hold_band * full_per_engine) - 1e-9))


def fleet_signal(per_replica: Mapping[Any, float | None] | None) -> float | None:
    """One figure for the fleet from each replica's: their mean, over the replicas that
    reported one (None where none did)."""
    values = [v for v in (per_replica or {}).values() if v is not None]
    return sum(values) / len(values) if values else None


def fleet_load(counts: Mapping[Any, float] | None) -> float:
    """The fleet's load: requests whose first token fell in the engines' latency windows,
    summed over the replicas (a rate times the window: only ever compared with itself)."""
    return float(sum(v for v in (counts or {}).values() if v))


def fleet_latency(p90s: Mapping[Any, float] | None, counts: Mapping[Any, float] | None,
                  min_samples: float = MIN_SAMPLES) -> float | None:
    """The replicas' p90s weighted by the samples behind each; None with fewer than
    `min_samples` over the fleet (an idle engine reports a count of 0: it weighs nothing)."""
    counts = counts or {}
    pairs = [(v, counts.get(r) or 0.0) for r, v in (p90s or {}).items() if v is not None]
    total = sum(n for _, n in pairs)
    if total < min_samples:
        return None
    return sum(v * n for v, n in pairs) / total


class EngineCapacity:
    """What one engine carries at the latency targets, as the fleet showed it over the last
    BREACH_MEMORY_S: loads per engine where a target broke and where every target held, the
    highest of each per LATENCY_WINDOW_S of time (Serve asks ten times a second)."""

    def __init__(self) -> None:
        self.breaches: dict[int, float] = {}
        self.carried: dict[int, float] = {}

    def record(self, now: float, per_engine: float, broke: bool) -> None:
        seen = self.breaches if broke else self.carried
        bucket = int(now // LATENCY_WINDOW_S)
        seen[bucket] = max(seen.get(bucket, 0.0), per_engine)

    def per_engine(self, now: float) -> float | None:
        """The highest load per engine at which a target broke, or the highest carried
        within them where that is more (a breach below what the fleet carried was not the
        load's); None where no target broke."""
        self.forget(now)
        if not self.breaches:
            return None
        return max([*self.breaches.values(), *self.carried.values()])

    def forget(self, now: float) -> None:
        """Drops what is older than BREACH_MEMORY_S."""
        oldest = (now - BREACH_MEMORY_S) // LATENCY_WINDOW_S
        self.breaches = {k: v for k, v in self.breaches.items() if k > oldest}
        self.carried = {k: v for k, v in self.carried.items() if k > oldest}

    def breaking(self, now: float) -> float | None:
        """The load per engine at which a target broke, where no engine was seen to carry
        more within every target (else the breaches were a burst's or a backlog's, not the
        load's); None where unknown."""
        self.forget(now)
        top = max(self.breaches.values(), default=None)
        if top is None or top < max(self.carried.values(), default=0.0):
            return None
        return top


class LoadTrend:
    """The fleet's load over the last LATENCY_WINDOW_S: where it will be `lead_s` ahead,
    rising at the pace it rose over that window (a falling load is projected flat), at most
    doubling per window (a count over a window is noisy, and the lead multiplies it)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []

    def ahead(self, now: float, load: float, lead_s: float) -> float:
        self.samples = [(t, v) for t, v in self.samples if now - t <= LATENCY_WINDOW_S]
        self.samples.append((now, load))
        t0, v0 = self.samples[0]
        if now - t0 < LATENCY_WINDOW_S / 2 or lead_s <= 0:
            return load
        rise = min(max(0.0, (load - v0) / (now - t0)), load / LATENCY_WINDOW_S)
        return load + rise * lead_s


def engines_ahead(projected: float, breaking: float | None) -> int:
    """Engines that carry the `projected` load below the load per engine at which a target
    broke (0 where that is unknown)."""
    if not breaking or projected <= 0:
        return 0
    return math.ceil(projected / breaking - 1e-9)


class EnginesForTargets:
    """The policy Serve instantiates once per deployment (policy_kwargs: the targets) and
    calls with its AutoscalingContext on every tick."""

    def __init__(self, hold_band: float = 0.6, ttft_p90_s: float | None = None,
                 itl_p90_s: float | None = None, kv_usage: float | None = None) -> None:
        # Checked here too: a Serve config reaches Serve's controller without rayattn's
        # schema having seen it.
        if not 0 < hold_band < 1:
            raise ValueError(f"hold_band must be in (0, 1), not {hold_band}")
        self.hold_band = hold_band
        self.capacity = EngineCapacity()
        """Lives as long as the deployment's autoscaling state in Serve's controller."""
        self.trend = LoadTrend()
        self.serving: int | None = None
        self.serving_grew_at: float | None = None
        """When the engines serving last grew in number: Serve's last_scale_up_time is the
        decision, and an engine may serve a minute after it."""
        self.resized_at: float | None = None
        """When the engines serving last changed in number, either way."""
        self.starts: dict[float, float] = {}
        """When an engine joined: how long after Serve's last scale-up decision (the
        decision that started it may be earlier: a later one cuts the figure short)."""
        self.targets = {k: v for k, v in zip(SIGNALS, (ttft_p90_s, itl_p90_s, kv_usage),
                                             strict=True) if v is not None}
        bad = {k: v for k, v in self.targets.items()
               if not v > 0 or (k == "kv_usage" and v > 1)}
        if bad or not self.targets:
            raise ValueError(f"targets must be > 0, at least one of {SIGNALS}: {bad}")

    def settling(self, ctx: AutoscalingContext) -> tuple[bool, bool, bool]:
        """Whether the latencies may still be from a smaller fleet (within the engines'
        window and Serve's look-back): since the last scale-up, and since an engine last
        joined. The first stops a latency growing the fleet again; the second, which runs
        on while engines keep joining, only stops a breach being learnt: read against
        engines that were not serving yet, it would understate what an engine carries.
        The third, since the fleet last changed size either way, stops the load's trend
        counting: the summed load jumps as an engine's first tokens leave or join the sum,
        then climbs back over the window, which is no rise of what users send."""
        current = ctx.current_num_replicas
        if self.serving is not None and current != self.serving:
            self.resized_at = ctx.current_time
        if self.serving is not None and current > self.serving:
            decided = ctx.last_scale_up_time
            # Timed only from a decision after the last join: a replica that replaces a
            # crashed one, or one of a rolling update, joins long after the last decision.
            if decided is not None and ctx.current_time - decided <= MAX_START_S and \
                    (self.serving_grew_at is None or decided > self.serving_grew_at):
                self.starts[ctx.current_time] = ctx.current_time - decided
            self.serving_grew_at = ctx.current_time
        self.serving = current
        settle_s = LATENCY_WINDOW_S + ctx.config.look_back_period_s

        def within(t: float | None) -> bool:
            return t is not None and ctx.current_time - t < settle_s
        return (within(ctx.last_scale_up_time), within(self.serving_grew_at),
                within(self.resized_at))

    def start_s(self, now: float) -> float:
        """How long an engine takes from Serve's decision to serving: the longest the fleet
        showed over the last BREACH_MEMORY_S (0 until it showed one)."""
        self.starts = {t: v for t, v in self.starts.items() if now - t < BREACH_MEMORY_S}
        return max(self.starts.values(), default=0.0)

    def pressures(self, ctx: AutoscalingContext) -> dict[str, float]:
        current = ctx.current_num_replicas
        out: dict[str, float] = {}
        if current > 0:
            out[ONGOING] = ctx.total_num_requests / (
                ctx.config.get_target_ongoing_requests() * current)
        metrics = ctx.aggregated_metrics or {}
        for name, target in self.targets.items():
            value = (fleet_latency(metrics.get(name), metrics.get(SAMPLES[name]))
                     if name in SAMPLES else fleet_signal(metrics.get(name)))
            if value is not None:
                out[name] = value / target
        return out

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        pressures = self.pressures(ctx)
        load = fleet_load((ctx.aggregated_metrics or {}).get(SAMPLES["ttft_p90_s"]))
        scaled_up, joined, resized = self.settling(ctx)
        if scaled_up:
            # A latency still from before the last scale-up may hold the fleet, not grow it
            # again (it would double on its own stale figure), nor say what the grown fleet
            # carries.
            pressures = {k: min(v, 1.0) if k in LATENCIES else v
                         for k, v in pressures.items()}
        elif not joined and load and ctx.current_num_replicas > 0 and \
                (latencies := [v for k, v in pressures.items() if k in LATENCIES]):
            self.capacity.record(ctx.current_time, load / ctx.current_num_replicas,
                                 broke=max(latencies) > 1.0)
        now = ctx.current_time
        floor = load_floor(load, self.capacity.per_engine(now), self.hold_band)
        # As far ahead as an engine asked for now would serve: Serve's delay, then its start
        # (none until the fleet has shown one: no breach is known before either).
        start_s = self.start_s(now)
        projected = self.trend.ahead(
            now, load, ctx.config.upscale_delay_s + start_s if start_s else 0.0)
        # Only before a target breaks: once one has (or the fleet is changing size), first
        # tokens rise with the engines added as a backlog drains, not with what users send.
        calm = not (scaled_up or resized) and \
            all(v <= 1.0 for k, v in pressures.items() if k in LATENCIES)
        ahead = engines_ahead(projected, self.capacity.breaking(now)) if calm else 0
        engines = engines_for(ctx.current_num_replicas, ctx.target_num_replicas, pressures,
                              self.hold_band, floor)
        # Serve keeps the returned state with the deployment: the last decision's reasons.
        return (max(engines, ahead),
                {"pressures": {k: round(v, 3) for k, v in pressures.items()},
                 "load_floor": floor, "ahead": ahead})
