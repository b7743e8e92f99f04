"""Admission, and the one retry loop around calls to the engine replicas.

What to route where is the routing core's (rayattn/routing/core.py): this module feeds it
the transport's facts — which replicas Serve runs and which answer (`ReplicaSet`), their KV
events (`KVFeeds`), what each call did — and makes the calls, pinned to the replica the core
chose (server/pinning.py). See docs/routing.md.

Failure semantics: an error the engine raises about the request itself (vLLM's
validation: ValueError / TypeError) is the client's: one 400 with vLLM's message, never
retried. A replica failure before any output reached the client is retried on another
replica, up to `router.max_retries` times, here and nowhere else, unless the engine crashed
while running the request (it may be what crashed it): that one is answered 503 and counted
in the quarantine (routing/quarantine.py), which refuses a prompt engines kept failing on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from rayattn.config.schema import RayAttnConfig, RouterConfig
from rayattn.engine import wire
from rayattn.engine.protocol import EngineInfo, OpenAIRequest, Reply
from rayattn.metrics.router_metrics import RouterMetrics
from rayattn.routing.core import CoreSnapshot, Finished, RoutingCore
from rayattn.routing.kv_budget import DEFAULT_OUTPUT_TOKENS
from rayattn.routing.policies import Decision, RouteRequest
from rayattn.routing.quarantine import Quarantine, fingerprint
from rayattn.routing.targets import replica_of, split, targets
from rayattn.server.background import detached
from rayattn.server.direct_client import DirectClient
from rayattn.server.errors import PROMPT_FIELD, APIError, EngineFailure, engine_raised
from rayattn.server.kv_feeds import KVFeeds
from rayattn.server.loop_watch import LoopWatch
from rayattn.server.pinning import PinnedHandle
from rayattn.server.replica_set import Replica, ReplicaSet, failure
from rayattn.server.tenant_limits import Admission, FairQueue, RateLimits, Slot

log = logging.getLogger("rayattn.router")


# How long a request waits for an engine replica when some exist but none is up.
NO_REPLICA_GRACE_S = 10.0

UNREACHABLE_S = 60.0
"""How long a replica whose direct endpoint could not be used gets Serve's channel."""

KV_RECHECK_S = 0.5
"""How often a request held by cache-pressure admission looks again without being woken."""


def _max_tokens(body: dict[str, Any]) -> int:
    """The output a request may add to the cache (cache-pressure admission)."""
    n = body.get("max_completion_tokens") or body.get("max_tokens") or \
        body.get("max_output_tokens")
    return n if isinstance(n, int) and n > 0 else DEFAULT_OUTPUT_TOKENS


@dataclass
class EngineStatus:
    """One routing target as /health shows it: an engine replica, or one DP rank of its
    engine (the replica's own facts repeated on each of its ranks)."""

    up: bool
    pid: int | None
    rank: int | None
    inflight: int
    local: int
    unfinished: int | None
    downs: int
    slow_probes: int
    kv_blocks: int | None
    backend: str | None
    block_size: int | None
    engine_pids: list[int]
    devices: list[str | None]
    cache_view: dict[str, Any]
    adapters: list[str] = field(default_factory=list)
    """The LoRA adapters its engine answers to."""
    engine_rank: int | None = None
    """The DP rank inside the engine this target is (None: the replica as a whole)."""
    autoscaled: bool | None = None
    """Whether its replica last said Serve autoscales the deployment, so calls to it keep to
    Serve's channel (None: no answer yet)."""


@dataclass
class RouterSnapshot:
    """The router's state for /health and /admin: read here, never reached into."""

    replicas_up: list[str]
    replicas: int
    joined: int
    policy: str
    index_mode: str
    max_inflight: int
    counts: dict[str, float]
    engines: dict[str, EngineStatus] = field(default_factory=dict)
    regret_tokens: dict[str, int] = field(default_factory=dict)
    """By decision reason, since start or the last reset (routing/core.py)."""
    session_moves: dict[str, int] = field(default_factory=dict)
    syncing: list[str] = field(default_factory=list)
    """Targets up whose KV event view is still being taken (kv_feeds.SYNC_GRACE_S)."""


@dataclass
class Gates:
    """What limits the router as a whole, whichever model a request names: its admission
    cap (router.max_inflight), each key's rate and fair share, and the watch on its event
    loop. One set per router, shared by its models' dispatchers."""

    admission: Admission
    rates: RateLimits
    fair: FairQueue
    stalls: LoopWatch

    @classmethod
    def of(cls, rc: RouterConfig) -> Gates:
        return cls(Admission(rc.max_inflight), RateLimits(rc.key_requests_per_s),
                   FairQueue(rc.key_max_inflight), LoopWatch())

    def apply(self, rc: RouterConfig) -> None:
        self.admission.limit = rc.max_inflight
        self.rates.rate, self.fair.key_cap = rc.key_requests_per_s, rc.key_max_inflight
        self.fair.wake_all()

    def counts(self) -> dict[str, float]:
        return {"admitted_now": self.admission.inflight, "admitted_peak": self.admission.peak,
                **self.stalls.counts()}


class Dispatcher:
    def __init__(self, cfg: RayAttnConfig, block_size: int, engines: Any,
                 metrics: bool = True, adapters: dict[str, str] | None = None,
                 gates: Gates | None = None) -> None:
        """`adapters`: the engines' LoRA adapters, name: path (Plan.adapters); `gates`:
        the router's own, where it routes several models (else this dispatcher's)."""
        self.cfg = cfg
        lora = cfg.model.lora
        # `origin` names this router in the engines' per-origin in-flight counts.
        self.core = RoutingCore(cfg.router.routing_settings(), block_size,
                                hash_algo=cfg.engine.prefix_caching_hash_algo,
                                hash_seed=cfg.engine.hash_seed, origin=uuid.uuid4().hex[:12],
                                adapters=adapters, adapter_slots=lora.max_loras,
                                adapters_cached=lora.cached)
        self.feeds = KVFeeds(self.core)
        self.metrics = RouterMetrics(cfg.model.name, self.core.policy.name) if metrics else None
        self._kv_waiters: dict[int, tuple[int, asyncio.Future[None]]] = {}
        """Requests held by cache-pressure admission, by arrival: (class, wake-up);
        continuing conversations are class 0."""
        self._kv_seq = itertools.count()
        self._engines = engines  # the engine deployment's handle
        self._streaming: tuple[str, Any] | None = None  # (transport, streaming handle)
        self._direct = DirectClient()
        self._unreachable: dict[str, tuple[str, float]] = {}
        """Replicas whose direct endpoint could not be used: (the address tried, until)."""
        self.fleet = ReplicaSet(engines, self._joined, self._left, on_info=self._probed)
        self.gates = gates or Gates.of(cfg.router)
        self.admission, self.rates = self.gates.admission, self.gates.rates
        self.fair, self.stalls = self.gates.fair, self.gates.stalls
        self.counts: dict[str, float] = {"sent": 0, "direct_calls": 0, "succeeded": 0,
                                         "retried": 0, "failed": 0,
                                         "engine_crashes": 0, "quarantined": 0,
                                         "kv_held": 0, "kv_held_s": 0.0}
        self.quarantine = Quarantine(cfg.router.quarantine_after, cfg.router.quarantine_s)
        self._metrics_task: asyncio.Task | None = None
        self.runtime_adapters: dict[str, str] = {}
        """LoRA adapters this router loaded at run time (name: path): loaded again on
        replicas that start later."""
        self._loading: set[tuple[str, str]] = set()

    # --- fleet view -------------------------------------------------------------------
    def live(self) -> list[str]:
        """The engine replicas that are up (Serve's names)."""
        return self.fleet.live()

    def _targets(self, r: Replica) -> list[str]:
        """What the core routes to on replica `r`: each of its engine's DP ranks, or the
        replica as a whole (routing/targets.py)."""
        ranks = r.info.dp_ranks if r.info is not None else 1
        return targets(r.name, ranks if self.core.settings.dp_rank_routing else 1)

    def live_targets(self) -> list[str]:
        """The routing targets of the replicas that are up."""
        return [t for n in self.fleet.live() for t in self._targets(self.fleet.members[n])]

    async def start(self) -> None:
        await self.fleet.start()
        self.stalls.start()
        if self._metrics_task is None:
            self._metrics_task = detached(self._report_loop())

    async def _report_loop(self) -> None:
        while True:
            self.feeds.restart_stale()
            if self.metrics is not None:
                live = self.live_targets()
                load = self.core.load
                index = self.core.index
                self.metrics.load(dict(load.inflight.items()), live, load.imbalance(live),
                                  len(self.live()), len(self.fleet.members),
                                  {r: (index.size(r), index.offloaded(r)) for r in live})
            await asyncio.sleep(self.fleet.period_s)

    def _joined(self, r: Replica) -> bool:
        info = r.info
        assert info is not None
        names = self._targets(r)
        for i, name in enumerate(names):
            # Engines naming the same GPUs share them (two engines on one GPU).
            device = ",".join(sorted(d for d in _devices(info, len(names), i) if d)) or None
            if not self.core.joined(name, info.block_size, _capacity(info, len(names), i),
                                    device, _batch(info, len(names)), info.host_kv_gib > 0):
                for joined in names[:i]:
                    self.core.left(joined)
                return False
        self._follow(r)
        self.fair.wake_all()  # room on the new replica
        return True

    def _follow(self, r: Replica) -> None:
        """Subscribe to the KV events of each of `r`'s targets: a rank's own stream, or the
        engine's one stream where it runs one rank. A replica routed to as a whole whose
        engine runs several ranks has no one stream: the router's view of it is what it
        sent there, for router.speculative_ttl_s (router.dp_rank_routing off)."""
        assert r.info is not None
        names = self._targets(r)
        if len(names) != r.info.dp_ranks:
            return
        for rank, (name, info) in enumerate(zip(names, r.info.ranks, strict=True)):
            self.feeds.join(name, info.kv_events, info.kv_events_key, r.handle, rank)

    def _left(self, r: Replica) -> None:
        self._unreachable.pop(r.name, None)
        for name in self._targets(r):
            if self.metrics is not None:
                self.metrics.left(name)
            self.feeds.leave(name)
            self.core.left(name)

    def _probed(self, r: Replica) -> None:
        assert r.info is not None
        names = self._targets(r)
        if len(names) == 1:
            self.core.reported(r.name, r.info.inflight_by_origin, r.info.inflight_stamp)
        else:
            for name, rank in zip(names, r.info.ranks, strict=True):
                self.core.reported(name, rank.inflight_by_origin, r.info.inflight_stamp)
        # An adapter's blocks are hashed with the path the engine loaded it from.
        self.core.adapter_paths.update(r.info.adapters)
        for name, path in self.runtime_adapters.items():
            if r.info.adapters.get(name) != path and (r.name, name) not in self._loading:
                # A replica that started after the adapter was loaded at run time.
                self._loading.add((r.name, name))
                detached(self._load_adapter(r, name, path))

    async def _load_adapter(self, r: Replica, name: str, path: str) -> None:
        try:
            reply = await r.handle.load_adapter.remote(name, path)
            if reply.status != 200:
                log.error("loading LoRA adapter %s on %s failed: %s", name, r.name,
                          reply.data[:300])
        except Exception as e:  # the next probe tries again
            log.warning("loading LoRA adapter %s on %s failed: %r", name, r.name, e)
        finally:
            self._loading.discard((r.name, name))

    def serving(self, adapter: str, among: list[str] | None = None) -> list[str]:
        """The live replicas (of `among`) whose engines answer to `adapter` now."""
        return [n for n in (self.live() if among is None else among)
                if (info := self.fleet.members[replica_of(n)].info)
                and adapter in info.adapters]

    def _refeed(self) -> None:
        """Every live replica's KV feed afresh (a new index, or a cold start): each resyncs
        from its engine's snapshot."""
        for name in list(self.feeds.feeds):
            self.feeds.leave(name)
        for name in self.live():
            r = self.fleet.members[name]
            if r.info is not None:
                self._follow(r)

    def apply_router_config(self, rc: RouterConfig) -> None:
        self.gates.apply(rc)
        self.quarantine.after, self.quarantine.hold_s = rc.quarantine_after, rc.quarantine_s
        if rc.dp_rank_routing != self.core.settings.dp_rank_routing:
            # Other targets on the same replicas: every replica leaves under the old names
            # and joins under the new ones, with views rebuilt from their engines' events.
            up = [self.fleet.members[n] for n in self.live()]
            for r in up:
                self._left(r)
            self.core.reconfigure(rc.routing_settings())
            for r in up:
                r.up = self._joined(r)
        elif self.core.reconfigure(rc.routing_settings()):
            self._refeed()
        if self.metrics is not None:
            self.metrics.set_policy(self.core.policy.name)

    async def reset(self, policy: str | None = None) -> str:
        """Cold-start every engine's prefix cache and the router's view; optionally switch
        policy. Used by benchmarks to compare policies on the same engines in one run."""
        live = [self.fleet.members[n] for n in self.live()]
        await asyncio.gather(*(r.handle.reset_prefix_cache.remote() for r in live))
        name = self.core.reset(policy)
        self._refeed()
        if self.metrics is not None:
            self.metrics.set_policy(name)
        return name

    def snapshot(self) -> RouterSnapshot:
        core: CoreSnapshot = self.core.snapshot()
        engines = {}
        for r in self.fleet.members.values():
            for n in self._targets(r):
                engines[n] = self._status(r, n, core)
        return RouterSnapshot(self.live(), len(self.fleet.members), self.fleet.joined,
                              core.policy, core.index_mode, self.admission.limit,
                              {**self.counts, **self.gates.counts()}, engines,
                              core.regret_tokens, core.session_moves, self.feeds.syncing())

    def _status(self, r: Replica, n: str, core: CoreSnapshot) -> EngineStatus:
        """Target `n` of replica `r`, as /health shows it."""
        info, view = r.info, core.routable.get(n)
        names = self._targets(r)
        i, rank = names.index(n), split(n)[1]
        cache_view: dict[str, Any] = {"blocks": view.blocks if view else 0,
                                      **self.feeds.stats(n)}
        if view is not None and view.speculative_blocks is not None:
            cache_view["speculative"] = view.speculative_blocks
        if view is not None and view.offloaded_blocks:
            cache_view["offloaded"] = view.offloaded_blocks
        if view is not None and self.core.settings.kv_admission:
            cache_view["admission_fill"] = round(view.admission_fill, 3)
        return EngineStatus(
            r.up, info.pid if info else None, info.rank if info else None,
            view.inflight if view else 0, view.local if view else 0,
            info.unfinished if info else None, r.downs, r.slow_probes,
            _capacity(info, len(names), i) if info else None,
            info.backend if info else None, info.block_size if info else None,
            info.engine_pids if info else [],
            _devices(info, len(names), i) if info else [], cache_view,
            sorted(info.adapters) if info else [], rank,
            info.autoscaled if info else None)

    def stream_interval_s(self) -> float:
        """How often a new stream may send a chunk: `stream_interval_ms`, or coarser when
        this router relays so many streams that they would exceed its message budget."""
        rc = self.cfg.router
        return max(rc.stream_interval_ms / 1e3,
                   self.admission.inflight / rc.stream_messages_per_s)

    # --- routing ------------------------------------------------------------------------
    def _reject(self, status: int) -> None:
        if self.metrics is not None:
            self.metrics.rejected.inc(1, {**self.metrics.base, "status": str(status)})

    def admit(self, tenant: str = "", weight: int = 1) -> Slot:
        """A place in this router for a request of `tenant` asking for `weight` engine
        requests (its n, its prompts), within the key's rate and fair share (429 beyond)."""
        try:
            self.rates.take(tenant)
            return self.admission.acquire(tenant, weight)
        except APIError:
            self._reject(429)
            raise

    def record_failure(self, cause: BaseException) -> None:
        self.counts["failed"] += 1
        if self.metrics is not None:
            self.metrics.failures.inc(1, {**self.metrics.base, "cause": type(cause).__name__})

    async def generate(self, req: OpenAIRequest, route: RouteRequest, buffered: bool = False,
                       tenant: str = "") -> AsyncIterator[tuple[Reply, Decision]]:
        """Stream items from one replica. A replica failure is retried on another replica
        while nothing has reached the caller: always before the first chunk, and at any
        point when `buffered` (chunks are held until the attempt completes, as a
        non-streaming response needs anyway). Otherwise EngineFailure propagates."""
        tried: set[str] = set()
        ticket = self.fair.ticket()
        # A prompt the router did not render (a Responses continuation: its history is in
        # one engine) has no identity here, and is not quarantined.
        prompt = fingerprint(route, self.core.block_size, tenant) if route.token_ids \
            else None
        if prompt is not None and (held_s := self.quarantine.refused_for(prompt)):
            self.counts["quarantined"] += 1
            self._reject(422)
            raise APIError(422, "engines crashed while running this prompt "
                                f"({self.cfg.router.quarantine_after} of them); it is refused "
                                f"for {held_s:.0f} s more (router.quarantine_after)",
                           param=PROMPT_FIELD[req.kind], code="request_quarantined")
        self.counts["sent"] += 1
        t0 = time.monotonic()
        wait_until = t0 + NO_REPLICA_GRACE_S  # one grace per request, retries included
        try:
            route.max_tokens = _max_tokens(req.body)
            for attempt in range(1 + self.cfg.router.max_retries):
                turn = (tenant, ticket)
                candidates = await (self._kv_admitted(route, tried, wait_until, turn)
                                    if self.core.settings.kv_admission
                                    else self._candidates(tried, wait_until, turn,
                                                          route.pinned, route.adapter))
                d = self.core.choose(route, candidates, retry=attempt > 0)
                tried.add(d.replica)
                if req.log:
                    log.info("request %s -> %s (%s; prompt %d tokens, %d predicted cached; "
                             "attempt %d)", req.request_id, d.replica, d.reason,
                             route.prompt_tokens, d.predicted_cached_tokens, attempt + 1)
                if self.metrics is not None:
                    self.metrics.decision(d)
                held: list[Reply] = []
                delivered = False
                try:
                    # aclosing: a client that leaves mid-stream ends the engine call (and
                    # releases its load) now, not when the generator is collected.
                    async with contextlib.aclosing(self._call(d, req, route, tenant)) as chunks:
                        async for chunk in chunks:
                            if buffered:
                                held.append(chunk)
                            else:
                                delivered = True
                                yield chunk, d
                except EngineCallError as err:
                    e = err.cause
                    kind = failure(e)
                    if kind == "request":
                        answer = engine_raised(e)
                        if answer.status >= 500:
                            log.error("engine error (not retried): %s: %s", type(e).__name__,
                                      str(e)[:500])
                        raise answer from e
                    self.fleet.dead(replica_of(d.replica), e)
                    log.warning("request %s failed on %s (%s: %s)", req.request_id, d.replica,
                                type(e).__name__, str(e)[:200])
                    if kind == "engine_crashed":
                        self.counts["engine_crashes"] += 1
                        if prompt is not None:
                            # One engine, however many of its ranks ran the prompt.
                            self.quarantine.failed(prompt, replica_of(d.replica))
                    if (delivered or attempt == self.cfg.router.max_retries
                            or kind == "engine_crashed"):
                        self.record_failure(e)
                        raise EngineFailure(d.replica, e, delivered,
                                            retryable=kind != "engine_crashed") from e
                    self.counts["retried"] += 1
                    if self.metrics is not None:
                        self.metrics.retries.inc(1, self.metrics.base)
                    continue
                for chunk in held:
                    yield chunk, d
                self.counts["succeeded"] += 1
                return
        finally:
            if self.metrics is not None:
                self.metrics.e2e.observe(time.monotonic() - t0, self.metrics.base)

    async def _candidates(self, tried: set[str], wait_until: float,
                          turn: tuple[str, int], pinned: str | None = None,
                          adapter: str | None = None) -> list[str]:
        """Live replicas (untried ones first) below this router's per-engine cap of
        serve.max_ongoing_requests; waits here, in the router, while all are at the cap or
        the request's key at its own, and takes its turn fairly among keys (FairQueue).
        `pinned`: the one replica that holds what the request continues."""
        cap = self.cfg.serve.max_ongoing_requests
        woken = False
        while True:
            live = self.live_targets()
            if not live and self.fleet.members and time.monotonic() < wait_until:
                # Replicas exist but none is up this instant (a retry right after the last
                # one was marked down, a probe that missed under load): wait a moment.
                await asyncio.sleep(0.1)
                continue
            if not live:
                self._reject(503)
                raise APIError(503, "no engine replica is ready", retry_after=5)
            if adapter is not None:
                # Only engines that answer to the adapter (one loaded at run time may be
                # on some of them only).
                live = self.serving(adapter, live)
                if not live:
                    raise APIError(404, f"The model `{adapter}` does not exist.",
                                   param="model", code="model_not_found")
            if pinned is not None:
                # The engine that stored a response keeps it in its front end, whichever
                # of its ranks ran it (and under whichever target names, router.dp_rank_
                # routing being live).
                home = replica_of(pinned)
                live = sorted((r for r in live if replica_of(r) == home and r not in tried),
                              key=lambda r: r != pinned)
                if not live and replica_of(pinned) in self.fleet.members \
                        and pinned not in tried \
                        and time.monotonic() < wait_until:
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
            woken = await self.fair.wait(*turn, holds=not tried)

    async def _kv_admitted(self, route: RouteRequest, tried: set[str],
                           wait_until: float, turn: tuple[str, int]) -> list[str]:
        """The candidates with KV room for `route` (routing/kv_budget.py); while there are
        none, the request waits here, woken as requests end, continuing conversations
        first and in arrival order within each class. The request's own timeout
        (router.request_timeout_s) bounds the wait."""
        prio = 0 if self.core.kv.is_live(route.session) else 1
        t0, seq = time.monotonic(), next(self._kv_seq)
        loop = asyncio.get_running_loop()
        try:
            while True:
                candidates = await self._candidates(tried, wait_until, turn, route.pinned,
                                                    route.adapter)
                if not self.core.settings.kv_admission:
                    return candidates  # switched off while this request waited
                room = self.core.kv_room(route, candidates)
                if room:
                    if seq in self._kv_waiters:
                        self.counts["kv_held"] += 1
                        self.counts["kv_held_s"] += time.monotonic() - t0
                    return room
                # One entry per waiting request, re-armed on every wake-up or re-check, so
                # its place (class, arrival) stays what it was when it first waited.
                wake: asyncio.Future[None] = loop.create_future()
                self._kv_waiters[seq] = (prio, wake)
                # Woken when a request ends; the timeout re-checks for conversations gone
                # idle.
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(wake, KV_RECHECK_S)
        finally:
            self._kv_waiters.pop(seq, None)

    def _kv_wake(self) -> None:
        """Load was released: every held request looks again, in priority order (the
        first ones take the room; the others wait again)."""
        for _, (_, wake) in sorted(self._kv_waiters.items(), key=lambda kv: (kv[1][0], kv[0])):
            if not wake.done():
                wake.set_result(None)

    async def _call(self, d: Decision, req: OpenAIRequest, route: RouteRequest,
                    tenant: str = "") -> AsyncIterator[Reply]:
        """Stream one attempt from one replica. Errors the call itself raises come out as
        EngineCallError (the engine's, Ray's or the direct transport's); anything else here
        is the router's own."""
        replica, req.engine_rank = split(d.replica)
        req.origin = self.core.load.origin
        chunks: AsyncGenerator[Reply, None] | None = None
        self.fair.started(tenant)
        try:
            self.core.dispatched(d, route)
            sent, sent_mono = time.time(), time.monotonic()
            chunks = self._engine_call(replica, req)
            while True:
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
                except Exception as e:
                    raise EngineCallError(e) from e
                if chunk.stamps and "router_in" not in chunk.stamps:  # the first item
                    chunk.stamps.update(router_out=sent, router_in=time.time())
                self.core.first_token(d)
                if chunk.inflight_by_origin is not None:
                    self.core.reported(d.replica, chunk.inflight_by_origin,
                                       chunk.inflight_stamp)
                # Learn only from a request that ran (not an error answer).
                if chunk.final and chunk.timings:
                    if (chunk.prompt_tokens + chunk.completion_tokens
                            - chunk.num_cached_tokens >= self.core.block_size):
                        self.feeds.expect(d.replica, sent_mono)  # new blocks: events are due
                    try:
                        self.core.finished(d, route, Finished(
                            chunk.prompt_tokens, chunk.num_cached_tokens, chunk.token_ids,
                            chunk.timings))
                    except Exception:  # learning must never fail a served request
                        log.exception("learning from request %s failed", req.request_id)
                    if self.metrics is not None:
                        self.metrics.outcome(d.predicted_cached_tokens, chunk.num_cached_tokens,
                                             chunk.prompt_tokens, chunk.timings.get("e2e_s", 0.0),
                                             d.predicted_reload_tokens)
                yield chunk
        finally:
            # Runs on success, failure and cancellation alike: the engine request is
            # cancelled (aborted in vLLM) and the replica's load released.
            try:
                if chunks is not None:
                    await chunks.aclose()
            finally:
                self.core.ended(d)
                self.fair.ended(tenant)
                if self._kv_waiters:
                    self._kv_wake()

    async def _engine_call(self, replica: str, req: OpenAIRequest
                           ) -> AsyncGenerator[Reply, None]:
        """One call's replies, over the direct transport where it is chosen and the replica
        offers it, else over Serve's channel. Closing the generator hangs up either way."""
        if self.cfg.router.engine_transport == "direct":
            r = self.fleet.members.get(replica)
            info = r.info if r is not None else None
            # An autoscaled deployment keeps to Serve's channel: Serve's autoscaler counts
            # only the calls it carries, and would never see this load.
            address = info.direct if info is not None and not info.autoscaled else None
            body = wire.encode_request(req) if address is not None else None
            shunned = self._unreachable.get(replica)
            if address is not None and body is not None and not (
                    shunned and shunned[0] == address.url and time.monotonic() < shunned[1]):
                try:
                    async with contextlib.aclosing(
                            self._direct.stream(address, replica, body)) as replies:
                        self.counts["direct_calls"] += 1
                        async for item in replies:
                            yield item
                    return
                except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError,
                        wire.EndpointUnusable) as e:
                    # Nothing ran. Where the process is gone, Serve's channel says so next;
                    # where only its port is out of reach (a firewall between nodes) or
                    # something else answers there, that replica's calls keep to Serve's
                    # channel for a while.
                    self._unreachable[replica] = (address.url,
                                                  time.monotonic() + UNREACHABLE_S)
                    log.warning("direct endpoint of %s unusable (%s): calls to it go over "
                                "Serve's channel for %.0f s", replica, e, UNREACHABLE_S)
        gen = self._stream_handle(replica).serve.remote(req)
        try:
            async for item in gen:
                yield item
        finally:
            gen.cancel()

    def _stream_handle(self, replica: str) -> PinnedHandle:
        """The engine deployment's streaming handle, aimed at `replica`; built once per
        transport (a live setting) rather than by Serve's `options()` on every request."""
        transport = self.cfg.router.engine_transport
        if self._streaming is None or self._streaming[0] != transport:
            if transport in ("grpc", "direct"):  # direct: for calls it cannot carry
                # Items are plain dataclasses of this package: the standard pickle is enough.
                handle = self._engines.options(stream=True, _by_reference=False,
                                               request_serialization="pickle",
                                               response_serialization="pickle")
            else:
                handle = self._engines.options(stream=True)
            self._streaming = (transport, handle)
        return PinnedHandle(self._streaming[1], replica)


def _capacity(info: EngineInfo, targets: int, i: int) -> int:
    """KV blocks of target `i` of an engine routed to as `targets` targets: a rank's own
    where each rank is one, else the engine's (vLLM's sum over its ranks)."""
    return info.ranks[i].num_gpu_blocks if targets > 1 else info.num_gpu_blocks


def _batch(info: EngineInfo, targets: int) -> int:
    """Requests one target runs in a batch: vLLM's max_num_seqs is per DP rank, so a target
    of several ranks (the engine routed as one) batches theirs."""
    return info.max_num_seqs * max(1, len(info.ranks) // targets)


def _devices(info: EngineInfo, targets: int, i: int) -> list[str | None]:
    """The GPUs target `i` computes on: DP ranks of one device each have their own."""
    per, rest = divmod(len(info.devices), targets)
    return info.devices[i * per:(i + 1) * per] if per and not rest else info.devices


class EngineCallError(Exception):
    """An exception raised by the call to an engine replica (not by the router's code)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause
