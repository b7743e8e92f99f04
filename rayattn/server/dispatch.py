"""One model's routing, composed of its rooms: the fleet (server/fleet/: which engine
replicas Serve runs and answer, their KV events, their adapters), the routing core
(routing/core.py: what to route where), the candidates and waits (server/forwarding/
candidates.py), the transport (server/forwarding/transport.py) and the one retry loop
(server/forwarding/retry.py). See docs/routing.md.

Failure semantics: an error the engine raises about the request itself (vLLM's
validation: ValueError / TypeError) is the client's: one 400 with vLLM's message, never
retried. A replica failure before any output reached the client is retried on another
replica, up to `router.max_retries` times, unless the engine crashed while running the
request (it may be what crashed it): that one is answered 503 and counted in the quarantine
(routing/quarantine.py), which refuses a prompt engines kept failing on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from rayattn.config.schema import RayAttnConfig, RouterConfig
from rayattn.engine.protocol import OpenAIRequest, Reply
from rayattn.metrics.router_metrics import RouterMetrics
from rayattn.routing.core import Finished, RoutingCore
from rayattn.routing.kv_budget import DEFAULT_OUTPUT_TOKENS
from rayattn.routing.policies import Decision, RouteRequest
from rayattn.routing.quarantine import Quarantine, fingerprint
from rayattn.routing.targets import replica_of, split
from rayattn.server.background import detached
from rayattn.server.errors import PROMPT_FIELD, APIError, EngineFailure, engine_raised
from rayattn.server.fleet import status
from rayattn.server.fleet.adapters import AdapterRegistry
from rayattn.server.fleet.autoscaling import EngineAutoscaling
from rayattn.server.fleet.replica_set import failure
from rayattn.server.fleet.status import RouterSnapshot
from rayattn.server.fleet.view import FleetView
from rayattn.server.fleet.warming import Warming
from rayattn.server.forwarding.candidates import Candidates
from rayattn.server.forwarding.retry import EngineCallError, retrying
from rayattn.server.forwarding.transport import EngineTransport
from rayattn.server.tenancy.admission import Slot
from rayattn.server.tenancy.gates import Gates

log = logging.getLogger("rayattn.router")

# How long a request waits for an engine replica when some exist but none is up.
RESET_ATTEMPTS, RESET_RETRY_S = 4, 0.5
"""How often /admin/reset asks an engine that refused to empty its cache, and how long
apart (vLLM refuses while blocks are in use)."""
NO_REPLICA_GRACE_S = 10.0


def _max_tokens(body: dict[str, Any]) -> int:
    """The output a request may add to the cache (cache-pressure admission)."""
    n = body.get("max_completion_tokens") or body.get("max_tokens") or \
        body.get("max_output_tokens")
    return n if isinstance(n, int) and n > 0 else DEFAULT_OUTPUT_TOKENS


class Dispatcher:
    def __init__(self, cfg: RayAttnConfig, block_size: int, engines: Any,
                 metrics: bool = True, adapters: dict[str, str] | None = None,
                 gates: Gates | None = None) -> None:
        """`engines`: the engine deployment's handle; `adapters`: the engines' LoRA
        adapters, name: path (Plan.adapters); `gates`: the router's own, where it routes
        several models (else this dispatcher's)."""
        self.cfg = cfg
        lora = cfg.model.lora
        # `origin` names this router in the engines' per-origin in-flight counts.
        self.core = RoutingCore(cfg.router.routing_settings(), block_size,
                                hash_algo=cfg.engine.prefix_caching_hash_algo,
                                hash_seed=cfg.engine.hash_seed, origin=uuid.uuid4().hex[:12],
                                adapters=adapters, adapter_slots=lora.max_loras,
                                adapters_cached=lora.cached)
        self.metrics = RouterMetrics(cfg.model.name, self.core.policy.name) if metrics else None
        self.counts: dict[str, float] = {"sent": 0, "direct_calls": 0, "succeeded": 0,
                                         "retried": 0, "failed": 0,
                                         "engine_crashes": 0, "quarantined": 0,
                                         "kv_held": 0, "kv_held_s": 0.0}
        self.gates = gates or Gates.of(cfg.router)
        self.adapters = AdapterRegistry(self.core)
        self.fleet = FleetView(self.core, engines, self.adapters, self.metrics,
                               on_join=self.gates.fair.wake_all,
                               on_leave=lambda replica: self.transport.forget(replica))
        self.feeds = self.fleet.feeds
        self.fleet.warming = Warming(self.core, lambda: self.fleet.members,
                                     self.fleet.up_targets,
                                     lambda: self.cfg.router.warm_engines,
                                     lambda: self.cfg.router.warm_timeout_s, self.counts,
                                     self.gates.fair.wake_all, self.metrics)
        self.autoscaling = EngineAutoscaling(engines.app_name, engines.deployment_name)
        self.transport = EngineTransport(engines, self.fleet.info,
                                         lambda: self.cfg.router.engine_transport, self.counts,
                                         lambda: self.autoscaling.now)
        self.candidates = Candidates(self.core, self.fleet, self.gates.fair,
                                     lambda: self.cfg.serve.max_ongoing_requests,
                                     self._reject, self.counts)
        self.quarantine = Quarantine(cfg.router.quarantine_after, cfg.router.quarantine_s)
        self._metrics_task: asyncio.Task | None = None

    def live(self) -> list[str]:
        """The engine replicas that are up (Serve's names)."""
        return self.fleet.live()

    async def start(self) -> None:
        await self.fleet.start()
        self.gates.stalls.start()
        if self._metrics_task is None:
            self._metrics_task = detached(self._report_loop())

    async def _report_loop(self) -> None:
        while True:
            self.feeds.restart_stale()
            self.autoscaling.poll()
            if self.metrics is not None:
                live = self.fleet.live_targets()
                load, index = self.core.load, self.core.index
                kv = self.core.kv
                fills = {r: kv.fill_of(r) * kv.share for r in live} \
                    if self.core.settings.kv_admission else None
                self.metrics.load(dict(load.inflight.items()), live, load.imbalance(live),
                                  len(self.live()), len(self.fleet.members),
                                  {r: (index.size(r), index.offloaded(r)) for r in live},
                                  fills, self.candidates.kv_waiting)
            await asyncio.sleep(self.fleet.replicas.period_s)

    # --- settings -----------------------------------------------------------------------
    def apply_router_config(self, rc: RouterConfig) -> None:
        self.gates.apply(rc)
        self.quarantine.after, self.quarantine.hold_s = rc.quarantine_after, rc.quarantine_s
        if rc.dp_rank_routing != self.core.settings.dp_rank_routing:
            self.fleet.retarget(lambda: self.core.reconfigure(rc.routing_settings()))
        elif self.core.reconfigure(rc.routing_settings()):
            self.fleet.refeed()
        if self.metrics is not None:
            self.metrics.set_policy(self.core.policy.name)

    async def reset(self, policy: str | None = None) -> tuple[str, list[str]]:
        """Cold-start every engine's prefix cache (and host tier) and the router's view;
        optionally switch policy. Used by benchmarks to compare policies on the same engines
        in one run. Returns the policy and the engines that did not empty: vLLM refuses
        while blocks are in use (a previous run's last requests), so each is asked again a
        few times first."""
        pending = {n: self.fleet.members[n] for n in self.live()}
        for attempt in range(RESET_ATTEMPTS):
            if attempt:
                await asyncio.sleep(RESET_RETRY_S)
            done = await asyncio.gather(*(r.handle.reset_prefix_cache.remote()
                                          for r in pending.values()))
            pending = {n: r for (n, r), ok in zip(pending.items(), done, strict=True)
                       if not ok}
            if not pending:
                break
        name = self.core.reset(policy)
        self.fleet.refeed()
        if self.metrics is not None:
            self.metrics.set_policy(name)
        return name, sorted(pending)

    def snapshot(self) -> RouterSnapshot:
        core = self.core.snapshot()
        return RouterSnapshot(self.live(), len(self.fleet.members), self.fleet.replicas.joined,
                              core.policy, core.index_mode, self.gates.admission.limit,
                              {**self.counts, **self.gates.counts()},
                              status.engines(self.fleet, core,
                                             bool(self.core.settings.kv_admission)),
                              core.regret_tokens, core.session_moves, self.feeds.syncing(),
                              {"share": round(self.core.kv.share, 4),
                               "window_s": round(self.core.kv.window_s, 2)}
                              if self.core.settings.kv_admission else None,
                              self.autoscaling.now)

    def stream_interval_s(self) -> float:
        """How often a new stream may send a chunk: `stream_interval_ms`, or coarser when
        this router relays so many streams that they would exceed its message budget."""
        rc = self.cfg.router
        return max(rc.stream_interval_ms / 1e3,
                   self.gates.admission.inflight / rc.stream_messages_per_s)

    # --- requests -----------------------------------------------------------------------
    def _reject(self, status: int) -> None:
        if self.metrics is not None:
            self.metrics.rejected.inc(1, {**self.metrics.base, "status": str(status)})

    def admit(self, tenant: str = "", weight: int = 1) -> Slot:
        """A place in this router for a request of `tenant` asking for `weight` engine
        requests (its n, its prompts), within the key's rate and fair share (429 beyond)."""
        try:
            self.gates.rates.take(tenant)
            return self.gates.admission.acquire(tenant, weight)
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
        ticket = self.gates.fair.ticket()
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
        route.max_tokens = _max_tokens(req.body)
        chosen: list[Decision] = []

        async def attempt(n: int) -> AsyncIterator[tuple[Reply, Decision]]:
            candidates = await self.candidates.get(route, tried, wait_until, (tenant, ticket))
            d = self.core.choose(route, candidates, retry=n > 0)
            tried.add(d.replica)
            chosen.append(d)
            if req.log:
                log.info("request %s -> %s (%s; prompt %d tokens, %d predicted cached; "
                         "attempt %d)", req.request_id, d.replica, d.reason,
                         route.prompt_tokens, d.predicted_cached_tokens, n + 1)
            if self.metrics is not None:
                self.metrics.decision(d)
            # aclosing: when the retry loop closes this attempt (the caller left), the
            # engine call ends and its load is released now, not when the abandoned
            # generator is finalized.
            async with contextlib.aclosing(self._call(d, req, route, tenant)) as chunks:
                async for chunk in chunks:
                    yield chunk, d

        def retry(err: EngineCallError, n: int, delivered: bool) -> bool:
            return self._judge(err.cause, chosen[-1].replica, n, delivered, req, prompt)

        try:
            async with contextlib.aclosing(retrying(attempt, retry, buffered)) as items:
                async for item in items:
                    yield item
            self.counts["succeeded"] += 1
        finally:
            if self.metrics is not None:
                self.metrics.e2e.observe(time.monotonic() - t0, self.metrics.base)

    def _judge(self, e: BaseException, target: str, n: int, delivered: bool,
               req: OpenAIRequest, prompt: Any) -> bool:
        """Whether a failed attempt on `target` is retried; raises the request's answer
        where it is not."""
        kind = failure(e)
        if kind == "request":
            answer = engine_raised(e)
            if answer.status >= 500:
                log.error("engine error (not retried): %s: %s", type(e).__name__,
                          str(e)[:500])
            raise answer from e
        self.fleet.replicas.dead(replica_of(target), e)
        log.warning("request %s failed on %s (%s: %s)", req.request_id, target,
                    type(e).__name__, str(e)[:200])
        if kind == "engine_crashed":
            self.counts["engine_crashes"] += 1
            if prompt is not None:
                # One engine, however many of its ranks ran the prompt.
                self.quarantine.failed(prompt, replica_of(target))
        if delivered or n == self.cfg.router.max_retries or kind == "engine_crashed":
            self.record_failure(e)
            raise EngineFailure(target, e, delivered,
                                retryable=kind != "engine_crashed") from e
        self.counts["retried"] += 1
        if self.metrics is not None:
            self.metrics.retries.inc(1, self.metrics.base)
        return True

    async def _call(self, d: Decision, req: OpenAIRequest, route: RouteRequest,
                    tenant: str = "") -> AsyncIterator[Reply]:
        """Stream one attempt from one replica, teaching the core what it did. Errors the
        call itself raises come out as EngineCallError (the engine's, Ray's or the direct
        transport's); anything else here is the router's own."""
        replica, req.engine_rank = split(d.replica)
        req.origin = self.core.load.origin
        chunks: AsyncGenerator[Reply, None] | None = None
        self.gates.fair.started(tenant)
        try:
            self.core.dispatched(d, route)
            sent, sent_mono = time.time(), time.monotonic()
            chunks = self.transport.call(replica, req)
            while True:
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
                except Exception as e:
                    raise EngineCallError(e) from e
                self._learn(d, route, req, chunk, sent, sent_mono)
                yield chunk
        finally:
            # Runs on success, failure and cancellation alike: the engine request is
            # cancelled (aborted in vLLM) and the replica's load released.
            try:
                if chunks is not None:
                    await chunks.aclose()
            finally:
                self.core.ended(d)
                self.gates.fair.ended(tenant)
                self.candidates.released()

    def _learn(self, d: Decision, route: RouteRequest, req: OpenAIRequest, chunk: Reply,
               sent: float, sent_mono: float) -> None:
        if chunk.stamps and "router_in" not in chunk.stamps:  # the first item
            chunk.stamps.update(router_out=sent, router_in=time.time())
        self.core.first_token(d)
        if chunk.inflight_by_origin is not None:
            self.core.reported(d.replica, chunk.inflight_by_origin, chunk.inflight_stamp)
        # Learn only from a request that ran (not an error answer).
        if not (chunk.final and chunk.timings):
            return
        if (chunk.prompt_tokens + chunk.completion_tokens - chunk.num_cached_tokens
                >= self.core.block_size):
            self.feeds.expect(d.replica, sent_mono)  # new blocks: events are due
        try:
            self.core.finished(d, route, Finished(chunk.prompt_tokens, chunk.num_cached_tokens,
                                                  chunk.token_ids, chunk.timings))
        except Exception:  # learning must never fail a served request
            log.exception("learning from request %s failed", req.request_id)
        if self.metrics is not None:
            self.metrics.outcome(d.predicted_cached_tokens, chunk.num_cached_tokens,
                                 chunk.prompt_tokens, chunk.timings.get("e2e_s", 0.0),
                                 d.predicted_reload_tokens)
