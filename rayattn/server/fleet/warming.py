"""Engines that come and go, without cold caches (router.warm_engines; what to prefill is
routing/warm_plan.py's):

- a replica that joins while others serve is held out of routing until the prefixes the
  router's conversations share are prefilled on it (at most router.warm_timeout_s), so its
  first conversations run the extend path;
- when a replica leaves the deployment (scale-down, a rolling update), its live
  conversations' histories are prefilled, one at a time, where the routing policy would send
  their next turns.

Prefills go over Serve's channel to the engine's `prefill` (one output token, not returned);
the engines' KV events then show the routing core what they cached."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from rayattn.metrics.router_metrics import RouterMetrics
from rayattn.routing.core import RoutingCore
from rayattn.routing.targets import replica_of, split
from rayattn.routing.warm_plan import Prefill
from rayattn.server.background import detached
from rayattn.server.fleet.replica_set import Replica

log = logging.getLogger("rayattn.router")


class Warming:
    def __init__(self, core: RoutingCore, members: Callable[[], dict[str, Replica]],
                 live_targets: Callable[[], list[str]], enabled: Callable[[], bool],
                 timeout_s: Callable[[], float], counts: dict[str, float],
                 on_warm: Callable[[], None], metrics: RouterMetrics | None = None) -> None:
        """`members()`: the replicas Serve runs; `live_targets()`: the targets routed to now;
        `enabled()` / `timeout_s()`: router.warm_engines / router.warm_timeout_s (live
        settings); `counts`: the router's; `on_warm`: a held target is routable now."""
        self.core = core
        self._members, self._live = members, live_targets
        self._enabled, self._timeout_s = enabled, timeout_s
        self.counts = counts
        for key in ("warm_prefills", "warm_tokens", "moved_conversations"):
            counts.setdefault(key, 0)
        self._on_warm = on_warm
        self._metrics = metrics
        self.warming: set[str] = set()
        """Targets held out of routing while they are warmed."""

    def joined(self, r: Replica, targets: list[str]) -> None:
        """`r` joined as `targets`: where other targets serve and the router's conversations
        share prefixes, hold them out of routing while those are prefilled."""
        if not self._enabled() or not [t for t in self._live() if t not in targets]:
            return
        plans = {t: plan for t in targets if (plan := self.core.warm_plan(t))}
        if plans:
            self.warming.update(plans)
            detached(self._warm(r, plans))

    def leaving(self, targets: list[str]) -> None:
        """`targets` (one replica's) are about to leave the routing core: prefill their live
        conversations on the targets that stay."""
        staying = [t for t in self._live() if t not in targets]
        if not self._enabled() or not staying:
            return
        plan = self.core.move_plan(targets, staying)
        if plan:
            detached(self._move(plan))

    def _counted(self, why: str, tokens: int) -> None:
        if self._metrics is not None and tokens > 0:
            self._metrics.warm_tokens.inc(tokens, {**self._metrics.base, "why": why})

    async def _warm(self, r: Replica, plans: dict[str, list[Prefill]]) -> None:
        t0 = time.monotonic()
        deadline = t0 + self._timeout_s()
        tokens = 0
        try:
            for target, plan in plans.items():
                rank = split(target)[1]
                for p in plan:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        log.warning("engine %s: warming stopped after %.0f s "
                                    "(router.warm_timeout_s)", target, time.monotonic() - t0)
                        return
                    cached = await asyncio.wait_for(
                        r.handle.prefill.remote(p.token_ids, rank, p.salt), left)
                    self.counts["warm_prefills"] += 1
                    self.counts["warm_tokens"] += len(p.token_ids) - cached
                    self._counted("join", len(p.token_ids) - cached)
                    tokens += len(p.token_ids)
            log.info("engine %s warmed with %d shared prefixes (%d tokens) in %.1f s",
                     r.name, sum(map(len, plans.values())), tokens, time.monotonic() - t0)
        except Exception as e:  # it left, died or was slow: it serves cold, as before
            log.warning("engine %s: warming failed (%s); routing to it cold", r.name,
                        type(e).__name__)
        finally:
            self.warming.difference_update(plans)
            self._on_warm()

    async def _move(self, plan: list[Prefill]) -> None:
        """One conversation at a time: a move competes with the staying engines' own
        requests."""
        moved = 0
        for p in plan:
            target = self.core.moved_to(p, [t for t in self._live() if t not in self.warming])
            r = self._members().get(replica_of(target)) if target is not None else None
            if target is None or r is None:
                continue
            try:
                cached = await asyncio.wait_for(
                    r.handle.prefill.remote(p.token_ids, split(target)[1], p.salt),
                    self._timeout_s())
            except Exception as e:
                log.warning("moving a conversation to %s failed (%s)", target,
                            type(e).__name__)
                continue
            moved += 1
            self.counts["moved_conversations"] += 1
            self._counted("move", len(p.token_ids) - cached)
        log.info("%d of %d conversations of a leaving engine prefilled where their next "
                 "turns go", moved, len(plan))
