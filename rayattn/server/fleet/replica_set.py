"""Which engine replicas exist and which are up.

Which exist comes from Serve (server/fleet/pinning.py: the engine deployment's replicas as its
request router hears of them, so a replica that starts under autoscaling or a rolling update
joins, and one that is leaving drops out before it drains). Which are up comes from the
engines themselves: a replica is out only when Ray says its actor is dead or its engine
says it is dead (`check_health` raising inside `info()`): a slow answer proves nothing
under saturation, so a probe that times out leaves the replica up and its cache view
intact. A replacement has a new id and joins with an empty view (as would an actor restarted
under the same id: a new PID). The same poll brings each engine's count of the requests in
it per sending router, from which every router takes the others' load (routing/load.py).

Probes go to the engine deployment next to generation traffic; the engine deployment's
Serve limit leaves room for them (rayattn/app.py), so they never queue behind generation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import grpc
from ray import exceptions as ray_exc

from rayattn.engine import wire
from rayattn.engine.protocol import EngineDown, EngineInfo, Misrouted
from rayattn.integrations.vllm_engine import engine_crash_types
from rayattn.server.background import detached
from rayattn.server.fleet.pinning import Membership, PinnedHandle

log = logging.getLogger("rayattn.router")

# How long a starting router waits for one of the existing engine replicas to answer.
READY_WAIT_S = 60.0

# Errors that mean the replica (not the request) is gone.
REPLICA_DEAD: tuple[type[BaseException], ...] = (
    ray_exc.RayActorError, ray_exc.ActorDiedError, ray_exc.ActorUnavailableError)


Failure = Literal["request", "never_ran", "replica_died", "engine_crashed"]
"""How a call to an engine replica failed:
- `request`: an error about the request itself (not a death);
- `never_ran`: the replica had left or its engine was already dead when the call arrived;
- `replica_died`: the replica's process (or the connection to it) went away: a node lost,
  a process killed, which a request can hardly cause;
- `engine_crashed`: vLLM's engine died while running the request, which the request may
  have caused (a query of death)."""


def failure(e: BaseException) -> Failure:
    # The direct transport: the engine's exception by its kind, or the connection lost.
    if isinstance(e, wire.EngineRaised):
        return e.raised.failure
    if isinstance(e, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError,
                      wire.StreamCut)):
        return "replica_died"
    cause = getattr(e, "cause", None)
    # Raised by a replica for a call meant for one that has just left, or by one whose
    # engine was dead before the call: route it again.
    if isinstance(e, (Misrouted, EngineDown)) or isinstance(cause, (Misrouted, EngineDown)):
        return "never_ran"
    if isinstance(e, REPLICA_DEAD):
        return "replica_died"
    # gRPC transport: Serve maps UNAVAILABLE (and a peer's CANCELLED before the handler ran)
    # to ActorUnavailableError; a replica that goes away mid-stream can still surface as the
    # raw RPC error with these codes. Errors about the request itself arrive as the engine's
    # own exception; other RPC codes (e.g. a message over the size limit) are not deaths.
    if isinstance(e, grpc.aio.AioRpcError) and e.code() in (
            grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL):
        return "replica_died"
    return "engine_crashed" if isinstance(e, engine_crash_types()) else "request"


def engine_dead(e: BaseException) -> bool:
    """True when `e` says the engine replica is gone (not that one request was bad)."""
    return failure(e) != "request"


@dataclass
class Replica:
    name: str
    handle: Any
    up: bool = False
    pid: int | None = None
    info: EngineInfo | None = None
    """The last probe reply (None until the first one)."""
    downs: int = 0
    """Times this replica was taken out (dead actor or engine, or replaced)."""
    slow_probes: int = 0
    """Probes that timed out while the replica stayed in (saturation, not death)."""
    last_seen: float = 0.0


class ReplicaSet:
    def __init__(self, engines: Any, on_up: Callable[[Replica], bool],
                 on_down: Callable[[Replica], None],
                 on_info: Callable[[Replica], None] = lambda r: None, period_s: float = 0.5,
                 timeout_s: float = 10.0) -> None:
        self._engines = engines  # the engine deployment's handle
        self.members: dict[str, Replica] = {}
        self._on_up, self._on_down, self._on_info = on_up, on_down, on_info
        self.period_s, self.timeout_s = period_s, timeout_s
        self._task: asyncio.Task | None = None
        self._ready = asyncio.Event()
        self._known = asyncio.Event()
        self._recheck: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self.joined = 0
        """Replicas that ever joined (Serve started them: scale-up, update, replacement)."""

    def live(self) -> list[str]:
        return [n for n, r in self.members.items() if r.up]

    def is_up(self, name: str) -> bool:
        r = self.members.get(name)
        return r is not None and r.up

    async def start(self) -> None:
        """Learn the members and start probing (once, however many requests call this at
        once); return when the first round is done."""
        if self._task is None:
            Membership.subscribe(self._engines.app_name, self._engines.deployment_name,
                                 self._membership)
            # The handle's Serve router (and with it the request router that publishes the
            # members) starts with the handle's first use.
            self._engines.options()
            self._task = detached(self._loop())
        await self._ready.wait()

    def _membership(self, names: list[str]) -> None:
        """Serve's current replicas of the engine deployment: new ones are probed at once,
        leaving ones are out at once (Serve no longer sends them new calls; their running
        requests finish there)."""
        for name in [n for n in self.members if n not in names]:
            r = self.members.pop(name)
            log.info("engine %s left the deployment (scale-down or update)", name)
            if r.up:  # a departure, not a failure: not counted in `downs`
                r.up = False
                self._on_down(r)
        fresh = [n for n in names if n not in self.members]
        for name in fresh:
            self.members[name] = Replica(name, PinnedHandle(self._engines, name))
            self.joined += 1
        self._known.set()
        if fresh and self._task is not None:
            # Only the new ones, outside the round's lock: a round can wait 10 s on a busy
            # engine, and a new replica should take traffic as soon as it answers.
            detached(self._probe_all([self.members[n] for n in fresh]))

    async def _loop(self) -> None:
        try:
            # Serve tells a new handle its replicas within milliseconds; don't wait long
            # for a deployment that has none yet.
            await asyncio.wait_for(self._known.wait(), timeout=5)
        except TimeoutError:
            pass
        started = time.monotonic()
        while True:
            try:
                await self.refresh()
            except Exception:  # the probe must outlive any one bad round
                log.exception("engine probe failed")
            # Ready once one replica is up, or at once when none exists yet (an app that
            # is starting). A router that starts next to serving engines (a rolling update)
            # takes traffic only after it reached one of them: a busy engine may miss the
            # first probe.
            if self.live() or not self.members or \
                    time.monotonic() - started > READY_WAIT_S:
                self._ready.set()
            await asyncio.sleep(self.period_s)

    async def _probe_all(self, replicas: list[Replica]) -> None:
        await asyncio.gather(*(self._probe(r) for r in replicas))

    async def refresh(self) -> None:
        async with self._lock:
            await asyncio.gather(*(self._probe(r) for r in list(self.members.values())))

    async def _probe(self, r: Replica) -> None:
        try:
            info = await asyncio.wait_for(r.handle.info.remote(), timeout=self.timeout_s)
            if self.members.get(r.name) is not r:
                return  # it left while the probe ran
        except TimeoutError:
            r.slow_probes += 1
            if r.up:
                log.warning("engine %s slow to answer its probe (%.0fs); keeping it in",
                            r.name, self.timeout_s)
            return
        except Exception as e:
            if engine_dead(e) or not r.up:
                self.mark_down(r, f"{type(e).__name__}: {str(e)[:200]}")
            else:
                log.warning("engine %s probe error kept it in: %s", r.name, type(e).__name__)
            return
        r.last_seen = time.monotonic()
        if r.pid is not None and info.pid != r.pid:
            self.mark_down(r, f"replaced (pid {r.pid} -> {info.pid})")
        r.info = info
        if not r.up:
            r.pid = info.pid
            # The router may refuse a replica it cannot route to correctly (block size).
            r.up = self._on_up(r)
            if r.up:
                log.info("engine %s up: %s", r.name, info)
        if r.up:
            self._on_info(r)

    def mark_down(self, r: Replica, why: str) -> None:
        if r.up:
            r.downs += 1
            log.warning("engine %s down: %s", r.name, why)
            r.up = False
            self._on_down(r)
        r.pid = None

    def dead(self, name: str, cause: BaseException) -> None:
        """A call to `name` failed with a replica-dead error: out now, probe soon (one
        extra round, however many calls failed)."""
        r = self.members.get(name)
        if r is None:
            return  # it already left the deployment
        self.mark_down(r, type(cause).__name__)
        if self._recheck is None or self._recheck.done():
            self._recheck = detached(self.refresh())

