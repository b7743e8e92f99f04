"""Choosing an engine replica for a request, calling it, and retrying on replica failure.

The pieces around it each do one job: `ReplicaSet` (membership, probes, engine-reported load),
`CacheView` (the index and its KV-event feeds), `LoadTracker`, the policy, `Admission` and
`RouterMetrics`. This module wires them and holds the one retry loop.

The engine replicas are one Serve deployment (autoscaled, rolled one replica at a time,
drained when leaving); which replica serves a request is still decided here, and the call is
pinned to it (routing/pinning.py). See docs/routing.md for the choice and its cost.

Failure semantics: an error the engine raises about the request itself (vLLM's
validation: ValueError / TypeError) is the client's: one 400 with vLLM's message, never
retried. A replica failure (dead actor, dead engine) before any output reached the client is
retried on another replica, up to `router.max_retries` times, here and nowhere else.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from rayattn.config.schema import RayAttnConfig
from rayattn.engine.protocol import OpenAIRequest, Reply
from rayattn.metrics.router_metrics import RouterMetrics
from rayattn.routing.cache_view import CacheView
from rayattn.routing.hashing import BlockHasher, to_key
from rayattn.routing.load import LoadTracker
from rayattn.routing.pinning import PinnedHandle
from rayattn.routing.policies import Decision, RouteRequest, make_policy
from rayattn.routing.replica_set import Replica, ReplicaSet, engine_dead
from rayattn.server.errors import APIError

log = logging.getLogger("rayattn.router")


class Admission:
    """At most `limit` requests in this router at once, counted from the moment a request
    is admitted (not when it reaches an engine), so a burst cannot overshoot."""

    def __init__(self, limit: int) -> None:
        self.limit, self.inflight, self.peak = limit, 0, 0

    def acquire(self) -> Slot:
        if self.inflight >= self.limit:
            raise APIError(429, f"router at its admission limit ({self.limit} in flight); "
                                "retry later", retry_after=1)
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        return Slot(self)


class Slot:
    """One admitted request's place; released exactly once, from whichever path ends the
    request first (response done, client gone, error before the response started)."""

    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission

    def release(self) -> None:
        if self._admission is not None:
            self._admission.inflight -= 1
            self._admission = None


# How long a request waits for an engine replica when some exist but none is up.
NO_REPLICA_GRACE_S = 10.0

# RouterConfig fields a policy is built from; other settings apply without rebuilding it.
POLICY_FIELDS = ("policy", "load_epsilon", "load_slack", "min_match_fraction",
                 "prefill_s_per_token", "extend_s_per_context_token", "decode_s_per_request",
                 "ray_prefix_match_rate_threshold", "ray_prefix_imbalanced_threshold")


class Dispatcher:
    def __init__(self, cfg: RayAttnConfig, block_size: int, engines: Any,
                 policy: str | None = None, metrics: bool = True) -> None:
        self.cfg = cfg
        # Names this router in the engines' per-origin in-flight counts (routing/load.py).
        self.load = LoadTracker(origin=uuid.uuid4().hex[:12])
        self.view = CacheView(cfg.router.index, cfg.router.speculative_ttl_s)
        self.hasher = BlockHasher(block_size, cfg.engine.prefix_caching_hash_algo,
                                  cfg.engine.hash_seed)
        self.policy = make_policy(policy or cfg.router.policy, self.view.index, self.load,
                                  block_size, cfg.router)
        self._policy_settings = {k: getattr(cfg.router, k) for k in POLICY_FIELDS}
        self._policy_settings["policy"] = self.policy.name
        self.metrics = RouterMetrics(cfg.model.name, self.policy.name) if metrics else None
        self._engines = engines  # the engine deployment's handle
        self._streaming: tuple[str, Any] | None = None  # (transport, streaming handle)
        self.replicas = ReplicaSet(
            engines, self._joined, self._left,
            on_info=lambda r: self.load.reported(r.name, r.info.get("inflight_by_origin", {}),
                                                 r.info.get("inflight_stamp")))
        self.admission = Admission(cfg.router.max_inflight)
        self.counts = {"sent": 0, "succeeded": 0, "retried": 0, "failed": 0}
        self._metrics_task: asyncio.Task | None = None

    # --- fleet view -------------------------------------------------------------------
    def live(self) -> list[str]:
        return self.replicas.live()

    async def start(self) -> None:
        await self.replicas.start()
        if self._metrics_task is None:
            self._metrics_task = asyncio.get_running_loop().create_task(self._report_loop())

    async def _report_loop(self) -> None:
        while True:
            live = self.live()
            if self.metrics is not None:
                self.metrics.load(dict(self.load.inflight.items()), live,
                                  self.load.imbalance(live), len(self.replicas.replicas))
            await asyncio.sleep(self.replicas.period_s)

    def _joined(self, r: Replica) -> bool:
        bs = r.info["block_size"]
        if bs != self.hasher.block_size and not self.live():
            # The engine is the authority on its block size (vLLM may override the configured
            # one for a backend): the first engine up sets what the router hashes.
            log.warning("engine %s reports KV block size %d (configured %d): hashing with %d",
                        r.name, bs, self.hasher.block_size, bs)
            self._set_block_size(bs)
        if bs != self.hasher.block_size:
            # Hashing with another block size would predict hits that never happen.
            log.error("engine %s uses KV block size %d but the router hashes %d-token blocks "
                      "(attention.block_size): not routing to it", r.name, bs,
                      self.hasher.block_size)
            return False
        self.view.join(r.name, r.info, r.handle)
        return True

    def _left(self, r: Replica) -> None:
        if self.metrics is not None:
            self.metrics.left(r.name)
        self.view.leave(r.name)
        self.policy.forget_replica(r.name)
        self.load.forget(r.name)

    def _set_block_size(self, block_size: int) -> None:
        self.hasher = BlockHasher(block_size, self.cfg.engine.prefix_caching_hash_algo,
                                  self.cfg.engine.hash_seed)
        self.policy = make_policy(self.policy.name, self.view.index, self.load, block_size,
                                  self.cfg.router)

    def apply_router_config(self, rc: Any) -> None:
        self.admission.limit = rc.max_inflight
        index_changed = rc.index != self.view.mode
        if index_changed:
            for name in list(self.view.feeds):
                self.view.leave(name)
            self.view = CacheView(rc.index, rc.speculative_ttl_s)
            for name in self.live():
                r = self.replicas.replicas[name]
                self.view.join(name, r.info, r.handle)
        # A policy holds learned state (cost model, session owners, ray_prefix's text tree):
        # rebuild it only when the policy or one of its own settings changed, or its index.
        mine = {k: getattr(rc, k) for k in POLICY_FIELDS}
        if index_changed or mine != self._policy_settings:
            self.policy = make_policy(rc.policy, self.view.index, self.load,
                                      self.hasher.block_size, rc)
            self._policy_settings = mine
        if self.metrics is not None and self.metrics.base["policy"] != rc.policy:
            self.metrics = RouterMetrics(self.cfg.model.name, rc.policy)

    async def reset(self, policy: str | None = None) -> str:
        """Cold-start every engine's prefix cache and the router's view; optionally switch
        policy. Used by benchmarks to compare policies on the same engines in one run."""
        live = [self.replicas.replicas[n] for n in self.live()]
        await asyncio.gather(*(r.handle.reset_prefix_cache.remote() for r in live))
        for r in live:
            self.view.join(r.name, r.info, r.handle)
        # Cold start means cold everywhere: a fresh policy forgets what it learned (sessions,
        # ray_prefix's text tree), so runs compared on the same engines start alike.
        switched = bool(policy) and policy != self.policy.name
        self.policy = make_policy(policy or self.policy.name, self.view.index, self.load,
                                  self.hasher.block_size, self.cfg.router)
        self._policy_settings["policy"] = self.policy.name
        if switched and self.metrics is not None:
            self.metrics = RouterMetrics(self.cfg.model.name, self.policy.name)
        return self.policy.name

    # --- routing ------------------------------------------------------------------------
    def route_request(self, token_ids: list[int], session: str | None, text: str) -> RouteRequest:
        hashes = self.hasher.full_hashes(token_ids)
        keys = [to_key(h) for h in hashes]
        head = keys[0] if keys else hash(tuple(token_ids[: self.hasher.block_size]))
        return RouteRequest(keys, len(token_ids), head, session, text, hashes, token_ids)

    def _reject(self, status: int) -> None:
        if self.metrics is not None:
            self.metrics.rejected.inc(1, {**self.metrics.base, "status": str(status)})

    def admit(self) -> Slot:
        try:
            return self.admission.acquire()
        except APIError:
            self._reject(429)
            raise

    def record_failure(self, cause: BaseException) -> None:
        self.counts["failed"] += 1
        if self.metrics is not None:
            self.metrics.failures.inc(1, {**self.metrics.base, "cause": type(cause).__name__})

    async def generate(self, req: OpenAIRequest, route: RouteRequest,
                       buffered: bool = False) -> AsyncIterator[tuple[Reply, Decision]]:
        """Stream items from one replica. A replica failure is retried on another replica
        while nothing has reached the caller: always before the first chunk, and at any
        point when `buffered` (chunks are held until the attempt completes, as a
        non-streaming response needs anyway). Otherwise EngineFailure propagates."""
        tried: set[str] = set()
        self.counts["sent"] += 1
        t0 = time.monotonic()
        wait_until = t0 + NO_REPLICA_GRACE_S  # one grace per request, retries included
        try:
            for attempt in range(1 + self.cfg.router.max_retries):
                candidates = await self._candidates(tried, wait_until)
                d = self.policy.choose(route, candidates)
                d.loads = {r: self.load.inflight[r] for r in candidates}
                tried.add(d.replica)
                if req.log:
                    log.info("request %s -> %s (%s; prompt %d tokens, %d predicted cached; "
                             "attempt %d)", req.request_id, d.replica, d.reason,
                             route.prompt_tokens, d.predicted_cached_tokens, attempt + 1)
                if self.metrics is not None:
                    self.metrics.decision(d.reason, d.replica)
                held: list[Reply] = []
                delivered = False
                try:
                    async for chunk in self._call(d, req, route):
                        if buffered:
                            held.append(chunk)
                        else:
                            delivered = True
                            yield chunk, d
                except EngineCallError as err:
                    e = err.cause
                    if not engine_dead(e):
                        raise _request_error(e) from e
                    self.replicas.dead(d.replica, e)
                    log.warning("request %s failed on %s (%s: %s)", req.request_id, d.replica,
                                type(e).__name__, str(e)[:200])
                    if delivered or attempt == self.cfg.router.max_retries:
                        self.record_failure(e)
                        raise EngineFailure(d.replica, e, delivered) from e
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

    async def _candidates(self, tried: set[str], wait_until: float) -> list[str]:
        """Live replicas (untried ones first) below this router's per-engine cap of
        serve.max_ongoing_requests; waits here, in the router, while all are at the cap."""
        cap = self.cfg.serve.max_ongoing_requests
        while True:
            live = self.live()
            if not live and self.replicas.replicas and time.monotonic() < wait_until:
                # Replicas exist but none is up this instant (a retry right after the last
                # one was marked down, a probe that missed under load): wait a moment.
                await asyncio.sleep(0.1)
                continue
            if not live:
                self._reject(503)
                raise APIError(503, "no engine replica is ready", retry_after=5)
            fresh = [r for r in live if r not in tried] or live
            open_ = [r for r in fresh if self.load.local[r] < cap]
            if open_:
                return open_
            await asyncio.sleep(0.005)

    async def _call(self, d: Decision, req: OpenAIRequest,
                    route: RouteRequest) -> AsyncIterator[Reply]:
        """Stream one attempt from one replica. Errors the call itself raises come out as
        EngineCallError (the engine's or Ray's); anything else here is the router's own."""
        replica = d.replica
        uncached = route.prompt_tokens - d.predicted_cached_tokens
        self.load.acquire(replica, uncached)
        req.origin = self.load.origin
        prefill_pending = True
        gen = None
        try:
            self.policy.on_dispatch(replica, route)
            d.dispatched_at = time.perf_counter()
            try:
                gen = self._stream_handle(replica).serve.remote(req)
            except Exception as e:
                raise EngineCallError(e) from e
            while True:
                try:
                    chunk = await gen.__anext__()
                except StopAsyncIteration:
                    break
                except Exception as e:
                    raise EngineCallError(e) from e
                if prefill_pending:
                    self.load.prefill_done(replica, uncached)
                    prefill_pending = False
                if chunk.inflight_by_origin is not None and self.replicas.is_up(replica):
                    self.load.reported(replica, chunk.inflight_by_origin, chunk.inflight_stamp)
                # Learn only from a request that ran (not an error answer) on a replica
                # still in the set: one that left must not re-enter the index.
                if chunk.final and chunk.timings and self.replicas.is_up(replica):
                    try:
                        self._learn(d, route, chunk)
                    except Exception:  # learning must never fail a served request
                        log.exception("learning from request %s failed", req.request_id)
                yield chunk
        finally:
            # Runs on success, failure and cancellation alike: the engine request is
            # cancelled (aborted in vLLM) and the replica's load released.
            if gen is not None:
                gen.cancel()
            self.load.release(replica, uncached if prefill_pending else 0)

    def _stream_handle(self, replica: str) -> PinnedHandle:
        """The engine deployment's streaming handle, aimed at `replica`; built once per
        transport (a live setting) rather than by Serve's `options()` on every request."""
        transport = self.cfg.router.engine_transport
        if self._streaming is None or self._streaming[0] != transport:
            if transport == "grpc":
                # Items are plain dataclasses of this package: the standard pickle is enough.
                handle = self._engines.options(stream=True, _by_reference=False,
                                               request_serialization="pickle",
                                               response_serialization="pickle")
            else:
                handle = self._engines.options(stream=True)
            self._streaming = (transport, handle)
        return PinnedHandle(self._streaming[1], replica)

    def _learn(self, d: Decision, route: RouteRequest, last: Reply) -> None:
        # Multi-turn: the engine now caches the prompt and every generated token but the
        # last (whose KV was never computed); index those so the next turn finds its whole
        # history (with KV events, until the events confirm it). Only the blocks after the
        # prompt's are new: reuse its hashes.
        full = self.hasher.full_hashes(route.token_ids + last.token_ids[:-1],
                                       route.block_hashes)
        self.policy.on_complete(d.replica, route.keys + [to_key(h) for h in
                                                         full[len(route.block_hashes):]])
        t = last.timings
        self.policy.observe(d.replica, last.prompt_tokens - last.num_cached_tokens, t,
                            self.load.inflight[d.replica])
        if self.metrics is not None:
            self.metrics.outcome(d.predicted_cached_tokens, last.num_cached_tokens,
                                 last.prompt_tokens, t.get("e2e_s", 0.0))


def _request_error(e: BaseException) -> APIError:
    """An engine-side exception about the request itself → the client's 4xx."""
    from rayattn.compat import client_error_types

    # Ray's RayTaskError carries the engine's own exception as `cause`.
    cause = getattr(e, "cause", None) or e
    if isinstance(cause, client_error_types()):
        return APIError(400, f"engine rejected the request: {str(cause)[:500]}",
                        param=getattr(cause, "parameter", None))
    log.error("engine error (not retried): %s: %s", type(e).__name__, str(e)[:500])
    return APIError(500, f"engine error: {type(e).__name__}")


class EngineCallError(Exception):
    """An exception raised by the call to an engine replica (not by the router's code)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class EngineFailure(Exception):
    def __init__(self, replica: str, cause: BaseException, started: bool) -> None:
        super().__init__(f"engine {replica} failed: {type(cause).__name__}: {cause}")
        self.replica, self.cause, self.started = replica, cause, started
