"""Engines that come and go in the simulator (rayattn/bench/simulate.py): Serve's autoscaler
running the shipped policy (rayattn/engine/scaling_policy.py `EnginesForTargets`) on the
signals the simulated engines report, as real engine replicas report them
(rayattn/engine/load_signals.py), with Serve's bounds and up/down-scale delays; an engine
takes `start_s` from the decision to its first request. Joining engines are warmed and
leaving engines' conversations moved by the routing core's own plans (router.warm_engines:
rayattn/routing/warm_plan.py), which the simulator sends as one-token prefills.

Pure: no Ray, no clock of its own; the simulator calls `tick` on its simulated time."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING

from rayattn.bench.stats import percentile
from rayattn.engine.scaling_policy import LATENCY_WINDOW_S, EnginesForTargets

if TYPE_CHECKING:
    from rayattn.config.schema import EngineAutoscaling, RouterConfig
    from rayattn.routing.core import RoutingCore
    from rayattn.routing.prefix_index import PrefixIndex


@dataclass
class FleetScaling:
    """The simulated engine deployment's autoscaling: the schema's own
    (`serve.engine_autoscaling`: bounds, Serve's delays and loop period, the targets), and
    how long an engine takes to start. Warming is the router's (router.warm_engines,
    router.warm_timeout_s: the simulator's RouterConfig)."""

    autoscaling: EngineAutoscaling
    start_s: float = 60.0
    """From Serve's decision to the engine's first request (placement, model load)."""

    def __post_init__(self) -> None:
        if not self.autoscaling.targets:
            raise ValueError("fleet scaling runs rayattn's policy: set a target "
                             "(ttft_p90_s, itl_p90_s or kv_usage)")
        if self.start_s <= 0:
            raise ValueError("start_s must be > 0")

    def policy(self) -> EnginesForTargets:
        return EnginesForTargets(self.autoscaling.hold_band, **self.autoscaling.targets)


@dataclass
class EngineSignals:
    """What one engine reports to Serve's autoscaler: its first-token times over the last
    LATENCY_WINDOW_S, and its KV usage averaged over its steps since the last report."""

    ttfts: deque[tuple[float, float]] = field(default_factory=deque)
    """(when, seconds) of its first tokens."""
    kv_sum: float = 0.0
    kv_steps: int = 0
    kv_reports: deque[tuple[float, float]] = field(default_factory=deque)
    """(when, usage) per report, over Serve's look-back."""

    def first_token(self, now: float, ttft_s: float) -> None:
        self.ttfts.append((now, ttft_s))

    def step(self, usage: float) -> None:
        self.kv_sum += usage
        self.kv_steps += 1

    def report(self, now: float, look_back_s: float) -> tuple[float | None, int, float]:
        """(TTFT p90 or None, its samples, KV usage over the look-back)."""
        while self.ttfts and self.ttfts[0][0] < now - LATENCY_WINDOW_S:
            self.ttfts.popleft()
        usage = self.kv_sum / self.kv_steps if self.kv_steps else 0.0
        self.kv_sum, self.kv_steps = 0.0, 0
        self.kv_reports.append((now, usage))
        while self.kv_reports and self.kv_reports[0][0] < now - look_back_s:
            self.kv_reports.popleft()
        values = sorted(v for _, v in self.ttfts)
        p90 = percentile(values, 0.9) if values else None
        kv = sum(u for _, u in self.kv_reports) / len(self.kv_reports)
        return p90, len(values), kv


class Autoscaler:
    """Serve's controller around the shipped policy: at every push of the engines' metrics
    (metrics_interval_s) the policy's wish from the running engines' reports, kept only once
    it has held for the up- or down-scale delay (Serve's `_apply_delay_logic`, reimplemented
    on simulated time), within the bounds."""

    def __init__(self, scaling: FleetScaling, initial: int) -> None:
        self.s = scaling.autoscaling
        self.policy = scaling.policy()
        self.target = initial
        """The engines Serve aims for (starting ones included)."""
        self._wish_since: float | None = None
        self._wish_up: bool | None = None
        self.last_scale_up: float | None = None
        self.decisions: list[tuple[float, int, dict]] = []
        """(when, new target, the policy's pressures) of every change."""

    def tick(self, now: float, running: dict[str, EngineSignals], in_flight: int) -> int:
        """The target after this tick; `running`: the engines serving (not starting, not
        leaving) and their signals; `in_flight`: requests in flight on them."""
        metrics: dict[str, dict[str, float]] = {
            "ttft_p90_s": {}, "ttft_samples": {}, "kv_usage": {}}
        for name, sig in running.items():
            p90, n, kv = sig.report(now, self.s.look_back_period_s)
            if p90 is not None:
                metrics["ttft_p90_s"][name] = p90
            metrics["ttft_samples"][name] = n
            metrics["kv_usage"][name] = kv
        ctx = SimpleNamespace(
            current_num_replicas=len(running), target_num_replicas=self.target,
            total_num_requests=in_flight, aggregated_metrics=metrics,
            last_scale_up_time=self.last_scale_up, current_time=now,
            config=SimpleNamespace(get_target_ongoing_requests=lambda:
                                   self.s.target_ongoing_requests,
                                   look_back_period_s=self.s.look_back_period_s,
                                   upscale_delay_s=self.s.upscale_delay_s))
        wish, state = self.policy(ctx)  # type: ignore[arg-type]
        wish = max(self.s.min_replicas, min(self.s.max_replicas, wish))
        if wish == self.target:
            self._wish_since = self._wish_up = None
            return self.target
        up = wish > self.target
        if self._wish_up is not up:
            self._wish_since, self._wish_up = now, up
        delay = self.s.upscale_delay_s if up else self.s.downscale_delay_s
        assert self._wish_since is not None
        if now - self._wish_since + 1e-9 >= delay:
            self.target = wish
            self._wish_since = self._wish_up = None
            if up:
                self.last_scale_up = now
            self.decisions.append((now, wish, state.get("pressures", {})))
        return self.target


@dataclass
class Window:
    """One stretch of the timeline (by the requests' arrival)."""

    start_s: float
    engines: float = 0.0
    """Engines serving, averaged over the stretch."""
    requests: int = 0
    ttfts: list[float] = field(default_factory=list)

    def row(self, target_s: float | None) -> dict[str, float | int | bool | None]:
        p90 = percentile(sorted(self.ttfts), 0.9) if self.ttfts else None
        return {"start_s": self.start_s, "engines": round(self.engines, 2),
                "requests": self.requests, "ttft_p90_s": p90,
                "within": None if target_s is None or p90 is None else p90 <= target_s}


def windows_of(first_tokens: list[tuple[float, float]], engine_counts: list[tuple[float, int]],
               end_s: float, width_s: float) -> list[Window]:
    """The timeline in stretches of `width_s`: each request's TTFT in the stretch it arrived
    in (`first_tokens`: (arrival, ttft)), the engines serving from `engine_counts` ((when,
    count) at each change, in order)."""
    n = max(1, math.ceil(end_s / width_s))
    out = [Window(k * width_s) for k in range(n)]
    for arrived, ttft in first_tokens:
        w = out[min(n - 1, int(arrived // width_s))]
        w.requests += 1
        w.ttfts.append(ttft)
    for k, w in enumerate(out):
        lo, hi = k * width_s, (k + 1) * width_s
        area = 0.0
        for j, (t, count) in enumerate(engine_counts):
            t_next = engine_counts[j + 1][0] if j + 1 < len(engine_counts) else end_s
            area += count * max(0.0, min(hi, t_next) - max(lo, t))
        w.engines = area / width_s
    return out


class Members:
    """Which of the pool's engines the routers see, and what happens as they come and go:
    an engine that joins is held out of routing while every router's warm plan is prefilled
    on it (never the last one routable; at most `warm_timeout_s`); one that leaves takes no
    new requests, its live conversations are prefilled where each router's policy sends
    their next turns (one at a time per router, as the router does), and it leaves the
    routers' view once it has drained. `send(target, token_ids, on_done)` queues a one-token
    prefill on an engine and calls `on_done()` when it has run."""

    def __init__(self, pool: list[str], initial: int, cores: list[RoutingCore],
                 truth: PrefixIndex, capacity_blocks: int, max_seqs: int,
                 router: RouterConfig,
                 send: Callable[[str, list[int], Callable[[], None]], None]) -> None:
        """`router`: its warm_engines says whether engines are warmed and moved."""
        self.pool, self.cores, self.truth = pool, cores, truth
        self.capacity, self.max_seqs, self.warms, self.send = (capacity_blocks, max_seqs,
                                                               router.warm_engines, send)
        self.active: list[str] = []
        """Joined: serving, held or leaving."""
        self.held: dict[str, int] = {}
        """Joined engines held out of routing, with their warm prefills still to run."""
        self.leaving: set[str] = set()
        self.starting: dict[str, int] = {}
        """Engines starting, each with its start's number: a name stopped while it started
        and started again must not join on its first start's time."""
        self.joined_as: dict[str, int] = {}
        """The start each joined engine came from (a hold's timeout is its join's only)."""
        self.ever: set[str] = set()
        """Engines that ever joined."""
        self._starts = 0
        self.warm_prefills = self.moved = 0
        self.changes: list[tuple[float, int, int]] = []
        """(when, engines serving, engines holding resources: starting included)."""
        for name in pool[:initial]:
            self.join(name, 0.0, self.start(0.0)[1], warm=False)

    def serving(self) -> list[str]:
        """Joined and not leaving: what Serve counts as running."""
        return [n for n in self.active if n not in self.leaving]

    def routable(self) -> list[str]:
        up = self.serving()
        return [n for n in up if n not in self.held] or up

    def _changed(self, now: float) -> None:
        self.changes.append((now, len(self.serving()), len(self.active) + len(self.starting)))

    def start(self, now: float) -> tuple[str, int] | tuple[None, None]:
        """Serve starts a replica: the pool's first name not in use, and the start's number
        (None: the pool is spent)."""
        free = [n for n in self.pool if n not in self.active and n not in self.starting]
        if not free:
            return None, None
        self._starts += 1
        self.starting[free[0]] = self._starts
        self._changed(now)
        return free[0], self._starts

    def cancel_start(self, now: float) -> bool:
        """Serve stops a replica that is still starting (its first choice when it shrinks)."""
        if not self.starting:
            return False
        del self.starting[max(self.starting, key=self.pool.index)]
        self._changed(now)
        return True

    def started(self, name: str, start: int) -> bool:
        """Whether start number `start` of `name` is still on (not stopped meanwhile)."""
        return self.starting.get(name) == start

    def join(self, name: str, now: float, start: int, warm: bool = True) -> None:
        """Start `start` of `name` is up: it joins every router's view (held while it is
        warmed where `warm` and other engines serve)."""
        self.starting.pop(name, None)
        self.joined_as[name] = start
        self.ever.add(name)
        self.truth.add_replica(name, self.capacity)
        for c in self.cores:
            c.joined(name, c.block_size, self.capacity, max_batch=self.max_seqs)
        others = self.routable()
        self.active.append(name)
        self._changed(now)
        if not (warm and self.warms and others):
            return
        for c in self.cores:
            if not c.warms_engines:
                continue
            for p in c.warm_plans([name]).get(name, []):
                self.held[name] = self.held.get(name, 0) + 1
                self.warm_prefills += 1
                self.send(name, p.token_ids(), lambda n=name: self._warmed(n))

    def _warmed(self, name: str) -> None:
        if name in self.held:
            self.held[name] -= 1
            if self.held[name] <= 0:
                del self.held[name]

    def hold_expired(self, name: str, start: int) -> None:
        """router.warm_timeout_s passed since start `start` of `name` joined: it serves,
        warm or not."""
        if self.joined_as.get(name) == start:
            self.held.pop(name, None)

    def leave(self, now: float) -> str | None:
        """Serve stops the newest serving replica (None: none to stop)."""
        up = self.serving()
        if len(up) <= 1:
            return None
        name = max(up, key=self.pool.index)
        self.leaving.add(name)
        self.held.pop(name, None)
        self._changed(now)
        staying = self.routable()
        for c in self.cores:
            if c.warms_engines and self.warms:
                self._move_next(c, deque(c.move_plan([name], staying)))
        return name

    def _move_next(self, core: RoutingCore, plan: deque) -> None:
        while plan:
            p = plan.popleft()
            target = core.move_target(p, self.routable())
            if target is None:
                continue

            def done(p=p, target=target) -> None:
                core.moved(p, target)
                self.moved += 1
                self._move_next(core, plan)

            self.send(target, p.token_ids(), done)
            return

    def depart(self, name: str, now: float) -> None:
        """A leaving engine drained: out of every view."""
        self.leaving.discard(name)
        self.active.remove(name)
        for c in self.cores:
            c.left(name)
        self.truth.remove_replica(name)
        self._changed(now)
