"""Choosing an engine replica, calling it, and keeping the router's view of the fleet right.

Why explicit per-rank deployments instead of a custom Ray Serve RequestRouter: the router
must send *this* request to *that* replica. Serve's RequestRouter hands the chosen replica
to the oldest pending request under FIFOMixin (inexact affinity under concurrency), and
without it concurrent child calls of one ingress request hang; it also needs back-off
handling to avoid a spinning routing loop. One single-replica deployment per DP rank gives
exact, lock-free choice, stable rank identities for the index and metrics, and Serve still
restarts a failed rank.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ray import exceptions as ray_exc

from rayattn.config.schema import RayAttnConfig
from rayattn.engine.protocol import Chunk, GenerateRequest
from rayattn.metrics.router_metrics import RouterMetrics
from rayattn.routing.hashing import BlockHasher, to_key
from rayattn.routing.load import LoadTracker
from rayattn.routing.policies import Decision, RouteRequest, make_policy
from rayattn.routing.prefix_index import PrefixIndex
from rayattn.server.errors import APIError

log = logging.getLogger("rayattn.router")

# Errors that mean the replica (not the request) is gone.
_REPLICA_DEAD = (ray_exc.RayActorError, ray_exc.ActorDiedError, ray_exc.ActorUnavailableError)


@dataclass
class EngineState:
    name: str
    handle: Any
    up: bool = False
    pid: int | None = None
    info: dict[str, Any] = field(default_factory=dict)


class Dispatcher:
    def __init__(self, cfg: RayAttnConfig, block_size: int, engines: dict[str, Any],
                 policy: str | None = None, metrics: bool = True) -> None:
        self.cfg = cfg
        self.engines = {n: EngineState(n, h) for n, h in engines.items()}
        self.index = PrefixIndex()
        self.load = LoadTracker()
        self.hasher = BlockHasher(block_size, cfg.engine.prefix_caching_hash_algo,
                                  cfg.engine.hash_seed)
        self.policy = make_policy(policy or cfg.router.policy, self.index, self.load,
                                  block_size, cfg.router)
        self.metrics = RouterMetrics(cfg.model.name, self.policy.name) if metrics else None
        self.inflight = 0
        self.counts = {"sent": 0, "succeeded": 0, "retried": 0, "failed": 0}
        self._refresh_lock = asyncio.Lock()
        self._task: asyncio.Task | None = None

    # --- fleet view -------------------------------------------------------------------
    def live(self) -> list[str]:
        return [n for n, s in self.engines.items() if s.up]

    async def start(self) -> None:
        if self._task is None:
            await self.refresh()
            self._task = asyncio.get_running_loop().create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(2.0)
            try:
                await self.refresh()
            except Exception:  # the probe must outlive any one bad round
                log.exception("engine probe failed")

    async def refresh(self) -> None:
        async with self._refresh_lock:
            await asyncio.gather(*(self._probe(s) for s in self.engines.values()))
            if self.metrics is not None:
                live = self.live()
                self.metrics.load(dict(self.load.inflight), live, self.load.imbalance(live))

    async def _probe(self, s: EngineState) -> None:
        try:
            info = await asyncio.wait_for(s.handle.info.remote(), timeout=10)
        except Exception as e:
            if s.up:
                log.warning("engine %s down: %s", s.name, type(e).__name__)
            self._mark_down(s)
            return
        if s.pid is not None and info["pid"] != s.pid:
            # Serve replaced the replica: its cache starts empty.
            self._mark_down(s)
        if info["block_size"] != self.hasher.block_size and not self.live():
            # The engine is the authority on its block size (vLLM may override the configured
            # one for a backend): the first engine up sets what the router hashes.
            log.warning("engine %s reports KV block size %d (configured %d): hashing with %d",
                        s.name, info["block_size"], self.hasher.block_size, info["block_size"])
            self._set_block_size(info["block_size"])
        if info["block_size"] != self.hasher.block_size:
            # Hashing with another block size would predict hits that never happen: refuse
            # the replica loudly rather than route on a wrong index.
            if s.up or s.info.get("block_size") != info["block_size"]:
                log.error("engine %s uses KV block size %d but the router hashes %d-token "
                          "blocks (attention.block_size): not routing to it", s.name,
                          info["block_size"], self.hasher.block_size)
            self._mark_down(s)
            s.info = info
            return
        if not s.up:
            self.index.add_replica(s.name, info["num_gpu_blocks"])
            log.info("engine %s up: %s", s.name, info)
        s.up, s.pid, s.info = True, info["pid"], info

    def _set_block_size(self, block_size: int) -> None:
        self.hasher = BlockHasher(block_size, self.cfg.engine.prefix_caching_hash_algo,
                                  self.cfg.engine.hash_seed)
        for name in self.index.replicas:
            self.index.remove_replica(name)
        self.policy = make_policy(self.policy.name, self.index, self.load, block_size,
                                  self.cfg.router)

    def _mark_down(self, s: EngineState) -> None:
        if s.up or s.name in self.index.replicas:
            self.index.remove_replica(s.name)
            self.policy.forget_replica(s.name)
        s.up = False

    async def reset(self, policy: str | None = None) -> str:
        """Cold-start every engine's prefix cache and the router's index; optionally switch
        policy. Used by benchmarks to compare policies on the same engines in one run."""
        await asyncio.gather(*(s.handle.reset_prefix_cache.remote()
                               for s in self.engines.values() if s.up))
        for s in self.engines.values():
            if s.up:
                self.index.remove_replica(s.name)
                self.index.add_replica(s.name, s.info["num_gpu_blocks"])
        if policy and policy != self.policy.name:
            self.policy = make_policy(policy, self.index, self.load, self.hasher.block_size,
                                      self.cfg.router)
            if self.metrics is not None:
                self.metrics = RouterMetrics(self.cfg.model.name, self.policy.name)
        return self.policy.name

    # --- routing ------------------------------------------------------------------------
    def route_request(self, token_ids: list[int], session: str | None, text: str) -> RouteRequest:
        hashes = self.hasher.full_hashes(token_ids)
        keys = [to_key(h) for h in hashes]
        head = keys[0] if keys else hash(tuple(token_ids[: self.hasher.block_size]))
        return RouteRequest(keys, len(token_ids), head, session, text, hashes)

    def admit(self) -> None:
        if self.inflight >= self.cfg.router.max_inflight:
            self._reject(429)
            raise APIError(429, f"router at its admission limit "
                                f"({self.cfg.router.max_inflight} in flight); retry later",
                           retry_after=1)

    def _reject(self, status: int) -> None:
        if self.metrics is not None:
            self.metrics.rejected.inc(1, {**self.metrics.base, "status": str(status)})

    def record_retry(self) -> None:
        self.counts["retried"] += 1
        if self.metrics is not None:
            self.metrics.retries.inc(1, self.metrics.base)

    def record_failure(self, cause: BaseException) -> None:
        self.counts["failed"] += 1
        if self.metrics is not None:
            self.metrics.failures.inc(1, {**self.metrics.base, "cause": type(cause).__name__})

    async def generate(self, req: GenerateRequest, route: RouteRequest,
                       resend: bool = False) -> AsyncIterator[tuple[Chunk, Decision]]:
        """Stream chunks from one replica. A replica failing before its first chunk is
        retried on another (bounded); after output has started EngineFailure propagates and
        the caller decides (non-streaming callers resend with `resend=True`, streaming ones
        end the stream with an error) and records the outcome."""
        tried: set[str] = set()
        attempts = 1 + self.cfg.router.max_retries
        self.inflight += 1
        if not resend:
            self.counts["sent"] += 1
        t0 = time.monotonic()
        try:
            for attempt in range(attempts):
                candidates = [r for r in self.live() if r not in tried] or self.live()
                if not candidates:
                    self._reject(503)
                    raise APIError(503, "no engine replica is ready", retry_after=5)
                d = self.policy.choose(route, candidates)
                tried.add(d.replica)
                if self.metrics is not None:
                    self.metrics.decision(d.reason, d.replica)
                got_output = False
                try:
                    async for chunk in self._call(d, req, route):
                        got_output = True
                        yield chunk, d
                    self.counts["succeeded"] += 1
                    return
                except (asyncio.CancelledError, GeneratorExit, APIError):
                    raise
                except Exception as e:
                    dead = isinstance(e, _REPLICA_DEAD)
                    if dead:
                        self._mark_down(self.engines[d.replica])
                        asyncio.get_running_loop().create_task(self.refresh())
                    log.warning("request %s failed on %s (%s: %s)", req.request_id, d.replica,
                                type(e).__name__, str(e)[:200])
                    if got_output or attempt == attempts - 1:
                        raise EngineFailure(d.replica, e, got_output) from e
                    self.record_retry()
        finally:
            self.inflight -= 1
            if self.metrics is not None:
                self.metrics.e2e.observe(time.monotonic() - t0, self.metrics.base)

    async def _call(self, d: Decision, req: GenerateRequest,
                    route: RouteRequest) -> AsyncIterator[Chunk]:
        replica = d.replica
        uncached = route.prompt_tokens - d.predicted_cached_tokens
        self.load.acquire(replica, uncached)
        self.policy.on_dispatch(replica, route)
        prefill_pending = True
        out_tokens: list[int] = []
        gen = self.engines[replica].handle.options(stream=True).generate.remote(req)
        try:
            async for chunk in gen:
                if prefill_pending:
                    self.load.prefill_done(replica, uncached)
                    prefill_pending = False
                out_tokens.extend(chunk.token_ids)
                if chunk.finish_reason is not None:
                    self._learn(d, route, req, chunk, out_tokens)
                yield chunk
        finally:
            # Runs on success, failure and cancellation alike: the engine request is
            # cancelled (aborted in vLLM) and the replica's load released.
            gen.cancel()
            self.load.release(replica, uncached if prefill_pending else 0)

    def _learn(self, d: Decision, route: RouteRequest, req: GenerateRequest, last: Chunk,
               out_tokens: list[int]) -> None:
        # Multi-turn: the engine now caches prompt + generated tokens; index them all so the
        # next turn finds its whole history.
        # Only the blocks after the prompt's are new: reuse its hashes.
        full = self.hasher.full_hashes(req.prompt_token_ids + out_tokens, route.block_hashes)
        self.policy.on_complete(d.replica, [to_key(h) for h in full])
        t = last.timings
        cost = getattr(self.policy, "cost", None)
        if cost is not None and t:
            cost.observe_prefill(last.prompt_tokens - last.num_cached_tokens,
                                 last.num_cached_tokens, t.get("prefill_s", 0.0))
            cost.observe_decode(t.get("itl_s"), self.load.inflight[d.replica])
        if self.metrics is not None:
            self.metrics.outcome(d.predicted_cached_tokens, last.num_cached_tokens,
                                 last.prompt_tokens, t.get("e2e_s", 0.0) if t else 0.0)


class EngineFailure(Exception):
    def __init__(self, replica: str, cause: BaseException, started: bool) -> None:
        super().__init__(f"engine {replica} failed: {type(cause).__name__}: {cause}")
        self.replica, self.cause, self.started = replica, cause, started
