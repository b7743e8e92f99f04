"""Engines that come and go, without cold caches (router.warm_engines; what to prefill is
routing/warm_plan.py's):

- a replica that joins while others serve is held out of routing until the prefixes the
  router's conversations share are prefilled on it (at most router.warm_timeout_s), so its
  first conversations run the extend path; never the last one routable (a one-replica
  rolling update stops the old replica while the new one warms);
- when a replica leaves the deployment (scale-down, a rolling update), its live
  conversations' histories are prefilled, one at a time, where the routing policy would send
  their next turns.

Prefills go over Serve's channel to the engine's `prefill` (one output token, not returned);
the engines' KV events then show the routing core what they cached."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from rayattn.metrics.router_metrics import RouterMetrics
from rayattn.routing.core import RoutingCore
from rayattn.routing.targets import replica_of, split
from rayattn.routing.warm_plan import Prefill
from rayattn.server.background import detached
from rayattn.server.fleet.replica_set import Replica

log = logging.getLogger("rayattn.router")

DEPARTED_KEPT = 64
"""Replicas that left the deployment lately, remembered by name with their engine's pid."""

COUNTS = ("warm_prefills", "warm_tokens", "moved_conversations", "moved_tokens")
"""The router's counts of it (/health): prefills for joining engines and the tokens they
computed; conversations moved and the tokens their prefills computed."""


class Warming:
    def __init__(self, core: RoutingCore, members: Callable[[], dict[str, Replica]],
                 up_targets: Callable[[], list[str]], enabled: Callable[[], bool],
                 timeout_s: Callable[[], float], counts: dict[str, float],
                 on_warm: Callable[[], None], metrics: RouterMetrics | None = None) -> None:
        """`members()`: the replicas Serve runs; `up_targets()`: the targets of the replicas
        up, held or not; `enabled()` / `timeout_s()`: router.warm_engines /
        router.warm_timeout_s (live settings); `counts`: the router's; `on_warm`: a held
        target is routable now."""
        self.core = core
        self._members, self._up = members, up_targets
        self._enabled, self._timeout_s = enabled, timeout_s
        self.counts = counts
        for key in COUNTS:
            counts.setdefault(key, 0)
        self._on_warm = on_warm
        self._metrics = metrics
        self._departed: OrderedDict[str, int | None] = OrderedDict()
        """Replicas that left the deployment lately, with their engine's pid: one back under
        the same pid (Serve updated its config) kept its cache and is not warmed."""
        self._holds: dict[str, object] = {}
        """Targets held out of routing while they are warmed, each by the warming that
        holds it (a replica that comes back while its first warming runs is held anew)."""

    def routable(self, targets: list[str]) -> list[str]:
        """Of the targets up, those routed to: all but the held ones, or every one where
        only held ones are up."""
        if not self._holds:  # the per-request path, nearly always
            return targets
        free = [t for t in targets if t not in self._holds]
        return free or targets

    @property
    def holding(self) -> set[str]:
        """The targets held now."""
        return set(self._holds)

    def joined(self, r: Replica, targets: list[str]) -> None:
        """`r` joined as `targets`: where other targets serve and the router's conversations
        share prefixes, hold them out of routing while those are prefilled."""
        if r.name in self._departed and self._departed.pop(r.name) == r.pid:
            return  # back under the same engine process: its cache with it
        if not (self._enabled() and self.core.warms_engines) or \
                not [t for t in self.routable(self._up()) if t not in targets]:
            return
        plans = self.core.warm_plans(targets)
        if plans:
            token = object()
            for t in plans:
                self._holds[t] = token
            detached(self._warm(r, plans, token))

    def leaving(self, r: Replica, targets: list[str]) -> None:
        """`r`, as `targets`, left the deployment and is about to leave the routing core:
        prefill their live conversations on the targets that stay."""
        self._departed[r.name] = r.pid
        while len(self._departed) > DEPARTED_KEPT:
            self._departed.popitem(last=False)
        staying = [t for t in self._up() if t not in targets]
        if not (self._enabled() and self.core.warms_engines) or not staying:
            return
        plan = self.core.move_plan(targets, staying)
        if plan:
            detached(self._move(plan, targets))

    async def _prefill(self, r: Replica, target: str, p: Prefill, timeout_s: float) -> int:
        """One prefill on `target`; returns the tokens it computed. A timeout (or the
        caller's cancellation) cancels the engine's request too: awaiting Serve's response
        does not."""
        response: Any = r.handle.prefill.remote(p.token_ids(), split(target)[1], p.salt)
        try:
            cached = await asyncio.wait_for(response, timeout_s)
        except BaseException:
            cancel = getattr(response, "cancel", None)
            if cancel is not None:
                cancel()
            raise
        return p.tokens - int(cached)

    async def _warm(self, r: Replica, plans: dict[str, list[Prefill]], token: object) -> None:
        t0 = time.monotonic()
        deadline = t0 + self._timeout_s()
        tokens = 0
        try:
            for target, plan in plans.items():
                for p in plan:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        log.warning("engine %s: warming stopped after %.0f s "
                                    "(router.warm_timeout_s)", target, time.monotonic() - t0)
                        return
                    computed = await self._prefill(r, target, p, left)
                    self.counts["warm_prefills"] += 1
                    self.counts["warm_tokens"] += computed
                    self._counted("join", computed)
                    tokens += p.tokens
            log.info("engine %s warmed with %d shared prefixes (%d tokens) in %.1f s",
                     r.name, sum(map(len, plans.values())), tokens, time.monotonic() - t0)
        except Exception as e:  # it left, died or was slow: it serves cold, as before
            log.warning("engine %s: warming failed (%s); routing to it cold", r.name,
                        type(e).__name__)
        finally:
            for t in plans:
                if self._holds.get(t) is token:
                    del self._holds[t]
            self._on_warm()

    async def _move(self, plan: list[Prefill], leaving: list[str]) -> None:
        """One conversation at a time: a move competes with the staying engines' own
        requests."""
        moved = 0
        for p in plan:
            # At once: a conversation's next turn can come within a second (an agent). A
            # replica that only dropped out of Serve's list for a moment (Serve updating its
            # config) is back with its cache: the rest stay.
            if any((r := self._members().get(replica_of(t))) is not None and r.up
                   for t in leaving):
                log.info("engine %s is back: its conversations stay", replica_of(leaving[0]))
                break
            target = self.core.move_target(p, self.routable(self._up()))
            r = self._members().get(replica_of(target)) if target is not None else None
            if target is None or r is None:
                continue
            try:
                computed = await self._prefill(r, target, p, self._timeout_s())
            except Exception as e:
                log.warning("moving a conversation to %s failed (%s)", target,
                            type(e).__name__)
                continue
            self.core.moved(p, target)
            moved += 1
            self.counts["moved_conversations"] += 1
            self.counts["moved_tokens"] += computed
            self._counted("move", computed)
        log.info("%d of %d conversations of a leaving engine prefilled where their next "
                 "turns go", moved, len(plan))

    def _counted(self, why: str, tokens: int) -> None:
        if self._metrics is not None and tokens > 0:
            self._metrics.warm_tokens.inc(tokens, {**self._metrics.base, "why": why})
