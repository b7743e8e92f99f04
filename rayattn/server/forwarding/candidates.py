"""Which engine targets a request may go to now, and the waits for one: while every target
is at its cap, while the request's key is at its fair share (server/tenancy/admission.py),
and, under cache-pressure admission, while no target has KV room for it
(routing/kv_budget.py). The routing core then chooses among what this returns."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable

from rayattn.routing.core import RoutingCore
from rayattn.routing.policies import RouteRequest
from rayattn.routing.targets import replica_of
from rayattn.server.errors import APIError
from rayattn.server.fleet.view import FleetView
from rayattn.server.tenancy.admission import FairQueue

KV_RECHECK_S = 0.5
"""How often a request held by cache-pressure admission looks again without being woken."""


class Candidates:
    def __init__(self, core: RoutingCore, fleet: FleetView, fair: FairQueue,
                 cap: Callable[[], int], rejected: Callable[[int], None],
                 counts: dict[str, float]) -> None:
        """`cap()`: requests one target takes from this router (serve.max_ongoing_requests);
        `rejected(status)`: a request refused here; `counts`: the router's, where requests
        held for KV room are counted (kv_held, kv_held_s)."""
        self.core, self.fleet, self.fair = core, fleet, fair
        self._cap, self._rejected, self._counts = cap, rejected, counts
        self._kv_waiters: dict[int, tuple[int, asyncio.Future[None]]] = {}
        """Requests held by cache-pressure admission, by arrival: (class, wake-up);
        continuing conversations are class 0."""
        self._kv_seq = itertools.count()

    async def get(self, route: RouteRequest, tried: set[str], wait_until: float,
                  turn: tuple[str, int]) -> list[str]:
        # The first attempt's arrival teaches the budget the conversation's pause (how long
        # a conversation stays live: for admission, and for which conversations of an engine
        # that leaves are moved), whether admission is on or not.
        kv = self.core.kv
        continuing = kv.is_live(route.session) if tried else kv.arrived(route.session)
        try:
            if self.core.settings.kv_admission:
                return await self._kv_admitted(route, tried, wait_until, turn, continuing)
            return await self._open(route, tried, wait_until, turn)
        finally:
            route.queued = False

    async def _open(self, route: RouteRequest, tried: set[str], wait_until: float,
                    turn: tuple[str, int]) -> list[str]:
        """Live targets (untried ones first) below this router's per-engine cap; waits here,
        in the router, while all are at the cap or the request's key at its own, and takes
        its turn fairly among keys (FairQueue). `route.pinned`: the one target that holds
        what the request continues."""
        pinned, adapter = route.pinned, route.adapter
        cap = self._cap()
        woken = False
        while True:
            route.queued = False
            live = self.fleet.live_targets()
            if not live and self.fleet.members and time.monotonic() < wait_until:
                # Replicas exist but none is up this instant (a retry right after the last
                # one was marked down, a probe that missed under load): wait a moment.
                await asyncio.sleep(0.1)
                continue
            if not live:
                self._rejected(503)
                raise APIError(503, "no engine replica is ready", retry_after=5)
            if adapter is not None:
                # Only engines that answer to the adapter (one loaded at run time may be
                # on some of them only).
                live = self.fleet.serving(adapter, live)
                if not live:
                    raise APIError(404, f"The model `{adapter}` does not exist.",
                                   param="model", code="model_not_found")
            if pinned is not None:
                live = self._pinned(live, pinned, tried)
                if not live and replica_of(pinned) in self.fleet.members \
                        and pinned not in tried and time.monotonic() < wait_until:
                    await asyncio.sleep(0.1)  # a missed probe: it may be up again
                    continue
                if not live:
                    raise APIError(404, "the engine replica that stored the previous "
                                        "response is gone, and its state with it",
                                   param="previous_response_id")
            fresh = [r for r in live if r not in tried] or live
            open_ = [r for r in fresh if self.core.load.local.get(r, 0) < cap]
            if open_ and self.fair.may_go(*turn):
                return open_
            if woken:
                self.fair.pass_turn()  # the freed slot was not one this request could take
            route.queued = True
            woken = await self.fair.wait(*turn, holds=not tried)

    @staticmethod
    def _pinned(live: list[str], pinned: str, tried: set[str]) -> list[str]:
        """The engine that stored a response keeps it in its front end, whichever of its
        ranks ran it (and under whichever target names, router.dp_rank_routing being
        live)."""
        home = replica_of(pinned)
        return sorted((r for r in live if replica_of(r) == home and r not in tried),
                      key=lambda r: r != pinned)

    async def _kv_admitted(self, route: RouteRequest, tried: set[str],
                           wait_until: float, turn: tuple[str, int],
                           continuing: bool) -> list[str]:
        """The candidates with KV room for `route`; while there are none, the request waits
        here, woken as requests end, continuing conversations first and in arrival order
        within each class (a new conversation does not pass one that waits before it). The
        request's own timeout (router.request_timeout_s) bounds the wait; one too big for
        the budget by itself does not wait (KVBudget.room)."""
        prio = 0 if continuing else 1
        t0, seq = time.monotonic(), next(self._kv_seq)
        loop = asyncio.get_running_loop()
        try:
            while True:
                candidates = await self._open(route, tried, wait_until, turn)
                if not self.core.settings.kv_admission:
                    return candidates  # switched off while this request waited
                room = [] if self._behind(prio, seq) else self.core.kv_room(route, candidates)
                if room:
                    if seq in self._kv_waiters:
                        self._counts["kv_held"] += 1
                        self._counts["kv_held_s"] += time.monotonic() - t0
                    return room
                # One entry per waiting request, re-armed on every wake-up or re-check, so
                # its place (class, arrival) stays what it was when it first waited.
                wake: asyncio.Future[None] = loop.create_future()
                self._kv_waiters[seq] = (prio, wake)
                # Woken when a request ends; the timeout re-checks for conversations gone
                # idle.
                route.queued = True
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(wake, KV_RECHECK_S)
        finally:
            self._kv_waiters.pop(seq, None)

    @property
    def kv_waiting(self) -> int:
        """Requests waiting for KV room now."""
        return len(self._kv_waiters)

    def _behind(self, prio: int, seq: int) -> bool:
        """A request of a new conversation waits behind those that came before it and
        still wait, so a bigger one is not passed for ever by smaller ones (continuing
        conversations go first and need only their new tokens)."""
        return prio == 1 and any(p == 1 and s < seq for s, (p, _) in self._kv_waiters.items())

    def released(self) -> None:
        """Load was released: every request held for KV room looks again, in priority order
        (the first ones take the room; the others wait again)."""
        if not self._kv_waiters:
            return
        for _, (_, wake) in sorted(self._kv_waiters.items(), key=lambda kv: (kv[1][0], kv[0])):
            if not wake.done():
                wake.set_result(None)
