"""The engine replica: a Ray Serve deployment whose replica owns one vLLM AsyncLLM.

All engine replicas (rayattn's DP ranks) are one Serve deployment, autoscaled and updated by
Serve; the router chooses the replica for each call, and every method here takes the chosen
replica's id first (server/fleet/pinning.py) and refuses a call meant for another. The
replica's devices are reserved by the placement group Serve creates from the plan's bundles;
vLLM's Ray executor (TP×PP > 1) schedules its workers into that same group.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from rayattn import compat
from rayattn.config.loader import parse_args
from rayattn.config.plan import build_plan
from rayattn.engine import cpu_priority, wire
from rayattn.engine.direct_server import DirectServer
from rayattn.engine.kv_mirror import KVMirror, node_ip
from rayattn.engine.protocol import (
    DirectAddress,
    EngineDown,
    EngineInfo,
    Misrouted,
    OpenAIRequest,
    RankInfo,
    Reply,
)
from rayattn.integrations import patches, serve_private
from rayattn.integrations.devices import device_report_kwargs, engine_device_info
from rayattn.integrations.vllm_engine import engine_args, engine_crash_types
from rayattn.integrations.vllm_kv_events import dp_rank_endpoint
from rayattn.integrations.vllm_openai import lora_modules

log = logging.getLogger("rayattn.engine")


class EngineReplica:
    def __init__(self, args: dict[str, Any], metrics_enabled: bool = True) -> None:
        from rayattn import logs

        logs.setup()
        cfg = parse_args(args)
        plan = build_plan(cfg, prepare_model=True)
        # The engine core is a child process: it inherits this environment, including the
        # PYTHONHASHSEED that makes its block hashes match the router's.
        os.environ.update(plan.env)
        if (outside := compat.support_warning()) is not None:
            log.warning(outside)
        if (low := cpu_priority.warning()) is not None:
            log.warning(low)
        # vLLM-version/install fixes (flashinfer sampler, TCPStore port window)
        compat.apply_engine_env(os.environ, cfg.platform.kind, plan.engine_kwargs)
        # Engine processes must not outlive this replica (ray stop --force, SIGKILL): a
        # watcher in its own session ends them when this process is gone.
        from rayattn.engine import reaper

        self._reaper = reaper.start_for_current_process()

        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

        from rayattn.metrics.engine_metrics import EngineMetrics, make_step_logger_factory

        self.replica_id, self.rank = _serve_identity()
        self.cfg, self.plan = cfg, plan
        from rayattn.metrics import tracing

        self.tracing = tracing.make(cfg.tracing, "engine")
        self.metrics = (EngineMetrics(cfg.model.name, plan.backend.name, self.replica_id, self.rank)
                        if metrics_enabled else None)
        kwargs = dict(plan.engine_kwargs)
        loggers: list[Any] = [RayPrometheusStatLogger]
        if self.metrics is not None:
            kwargs.update(compat.step_metrics_kwargs(self.metrics))
            loggers.append(make_step_logger_factory(self.metrics))
        kwargs.update(device_report_kwargs(cfg.platform.kind, kwargs))
        self.dp_ranks = int(kwargs.get("data_parallel_size", 1))
        self.kv_mirrors: list[KVMirror] = []
        """One per DP rank: each rank's scheduler publishes its own cache's events."""
        if cfg.engine.kv_events and cfg.engine.enable_prefix_caching:
            # Routers follow this engine's cache from its own events; the mirror (subscribed
            # before the engine publishes anything) is what they resync from.
            from vllm.config import KVEventsConfig

            from rayattn.engine.kv_mirror import TOPIC, node_ip, private_ipc_endpoints

            # vLLM's sockets carry every tenant's token ids: IPC, in a private directory;
            # routers read the mirror's authenticated relay instead (kv_mirror.py).
            ipc_dir, pub, replay = private_ipc_endpoints()
            kwargs["kv_events_config"] = KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=pub,
                replay_endpoint=replay, topic=TOPIC)
            # The directory goes with rank 0's mirror, the last one closed.
            self.kv_mirrors = [
                KVMirror(dp_rank_endpoint(pub, r), dp_rank_endpoint(replay, r),
                         node_ip(), ipc_dir if r == 0 else None, rank=r)
                for r in range(self.dp_ranks)]
        t0 = time.monotonic()
        self.engine = AsyncLLM.from_engine_args(engine_args(kwargs), stat_loggers=loggers)
        cache = self.engine.vllm_config.cache_config
        self._facts = {
            "replica": self.replica_id,
            "pid": os.getpid(),
            "backend": plan.backend.name,
            "block_size": cache.block_size,
            "num_gpu_blocks": int(cache.num_gpu_blocks or 0),
            "max_model_len": self.engine.vllm_config.model_config.max_model_len,
            "max_num_seqs": self.engine.vllm_config.scheduler_config.max_num_seqs,
            "startup_s": round(time.monotonic() - t0, 2),
            "host_kv_gib": (cfg.engine.kv_offload.size_gib if cfg.engine.kv_offload.enabled
                            else 0.0),
        }
        self._inflight: Counter[tuple[int | None, str]] = Counter()
        """Requests in flight by (DP rank the router pinned them to, or None; origin)."""
        # Bumped on every change of the counts: reports taken at different moments (a probe
        # reply, chunks of concurrent requests) reach a router in any order, and it keeps
        # only the newest (routing/load.py).
        self._inflight_seq = 0
        self._openai_layer: Any = None
        self._openai_lock = asyncio.Lock()
        self._direct: DirectServer | None = None
        self._autoscaled_now, self._autoscaled_at = True, -AUTOSCALED_TTL_S
        self._facts["engine_pids"] = sorted(reaper.descendants(os.getpid(),
                                                               exclude={self._reaper.pid}))
        log.info("engine %s ready: %s", self.replica_id, self._facts)

    def _pinned(self, target: str | None) -> None:
        if target is not None and target != self.replica_id:
            raise Misrouted(f"call for engine replica {target} reached {self.replica_id}")

    async def info(self, target: str | None) -> EngineInfo:
        """Engine facts the router needs (KV capacity in blocks, block size) plus liveness."""
        self._pinned(target)
        await self.engine.check_health()
        await self._openai()
        direct = await self._direct_address()
        if self.metrics is not None:
            # Re-set on every probe: the gauge is only exported once this process's metrics
            # agent is up, which can be after __init__.
            par = self.cfg.parallelism
            self.metrics.info.set(1, {**self.metrics.tags, "tp": str(par.tensor_parallel_size),
                                      "ep": str(par.enable_expert_parallel).lower(),
                                      "platform": self.cfg.platform.kind})
        # Serve renumbers ranks 0..n-1 as replicas come and go: report the current one
        # (the metrics' dp_rank label keeps the rank this replica started with).
        self.rank = _serve_identity()[1]
        devices = await engine_device_info(self)
        adapters = (await self._openai()).adapters_served()
        report = self._inflight_report()
        # vLLM sums the ranks' capacities; the ranks are configured alike.
        per_rank = self._facts["num_gpu_blocks"] // self.dp_ranks
        ranks = [RankInfo(None, None, per_rank, self._inflight_of(r))
                 for r in range(self.dp_ranks)]
        for rank, mirror in zip(ranks, self.kv_mirrors, strict=False):
            rank.kv_events, rank.kv_events_key = mirror.endpoint, mirror.server_key.decode()
        return EngineInfo(**self._facts, rank=self.rank, devices=devices["devices"],
                          ranks=ranks,
                          adapters=adapters,
                          placement_group=devices["placement_group"],
                          worker_placement_groups=devices["worker_placement_groups"],
                          unfinished=self.engine.output_processor.get_num_unfinished_requests(),
                          direct=direct, autoscaled=await self._autoscaled(), **report)

    async def _autoscaled(self) -> bool:
        """Whether Serve autoscales this deployment, asked of Serve's controller at most once
        per AUTOSCALED_TTL_S (every router's probe asks twice a second). Until an answer
        comes, and while one does not, the last one holds, first True: routers keep to
        Serve's channel rather than hide load from the autoscaler."""
        now = time.monotonic()
        if now - self._autoscaled_at > AUTOSCALED_TTL_S:
            self._autoscaled_at = now
            try:
                from ray import serve

                ctx = serve.get_replica_context()
                known = await asyncio.wait_for(
                    serve_private.serve_autoscales(ctx.app_name, ctx.deployment), 2.0)
            except Exception:  # outside Serve, or the controller slow to answer
                known = None
            if known is not None:
                self._autoscaled_now = known
        return self._autoscaled_now

    def _inflight_of(self, rank: int | None) -> dict[str, int]:
        """In-flight requests per sending router: those pinned to DP rank `rank`, or (None)
        all of the engine's."""
        out: Counter[str] = Counter()
        for (r, origin), n in self._inflight.items():
            if rank is None or r == rank:
                out[origin] += n
        return dict(out)

    def _inflight_report(self, rank: int | None = None) -> dict[str, Any]:
        """In-flight requests per sending router (of DP rank `rank`, else of the engine),
        stamped (pid, change counter): sent with every probe and on each request's first
        and final chunk."""
        return {"inflight_by_origin": self._inflight_of(rank),
                "inflight_stamp": (os.getpid(), self._inflight_seq)}

    async def _direct_address(self) -> DirectAddress | None:
        """This replica's endpoint for the direct transport, started on the first probe
        (on the replica's own event loop, where the engine's output handler runs)."""
        if self._direct is None:
            self._direct = DirectServer(self.serve, _classify)
        return await self._direct.address(node_ip())

    def __del__(self) -> Coroutine[Any, Any, None] | None:
        # Serve calls this on graceful replica shutdown (redeploy, scale-down, serve
        # shutdown), on the replica's event loop, and awaits a coroutine it returns
        # (ray/serve/_private/replica.py, `_call_func_or_gen`): calls that came over the
        # direct transport are not in the count Serve drained first, so they finish before
        # the engine stops, within the same graceful_shutdown_timeout_s after which Serve's
        # controller kills the replica. Garbage collection ignores the return value.
        direct = getattr(self, "_direct", None)
        if direct is not None:
            direct.draining = True
            if direct.inflight and _loop_running():
                return self._drain_then_close(direct)
        self._close()
        return None

    async def _drain_then_close(self, direct: DirectServer) -> None:
        try:
            await direct.drain(max(0.0, self.cfg.serve.graceful_shutdown_timeout_s
                                   - DRAIN_MARGIN_S))
        finally:
            self._close()

    def _close(self) -> None:
        """Stop the engine core now rather than leaving it to the watcher."""
        for mirror in reversed(getattr(self, "kv_mirrors", [])):
            mirror.close()
        if getattr(self, "tracing", None) is not None:
            self.tracing.shutdown()  # the last batch of spans goes out
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:
                log.exception("engine shutdown failed")

    async def check_health(self) -> None:
        # Serve calls this periodically; raising makes Serve replace the replica. A live
        # actor with a dead engine core must count as unhealthy.
        await self.engine.check_health()

    async def kv_snapshot(self, target: str | None, rank: int = 0) -> Any:
        """The blocks DP rank `rank` of this engine caches now and the event sequence number
        that reflects (routers resync their view of that rank from it)."""
        self._pinned(target)
        from rayattn.routing.kv_events import Snapshot

        return self.kv_mirrors[rank].snapshot() if self.kv_mirrors else Snapshot(-1, [])

    async def kv_subscribe(self, target: str | None, router_key: str) -> None:
        """Admit a router's CurveZMQ public key to this engine's KV event relays, one per DP
        rank (the call comes over Ray, the channel every request already takes)."""
        self._pinned(target)
        for mirror in self.kv_mirrors:
            mirror.admit(router_key.encode())

    async def load_adapter(self, target: str | None, name: str, path: str) -> Reply:
        """vLLM's run-time LoRA load (model.lora.runtime_updates): its answer, as vLLM's
        /v1/load_lora_adapter gives it."""
        self._pinned(target)
        return await (await self._openai()).load_adapter(name, path)

    async def unload_adapter(self, target: str | None, name: str) -> Reply:
        self._pinned(target)
        return await (await self._openai()).unload_adapter(name)

    async def reset_prefix_cache(self, target: str | None) -> bool:
        """Empty the prefix cache and the host KV tier behind it (benchmarks compare policies
        from the same cold start; a warm host tier would serve the last run's prompts)."""
        self._pinned(target)
        marks = [mirror.mark() for mirror in self.kv_mirrors]
        # Only where there is a host tier: some vLLM versions answer False to a connector
        # reset on an engine without a connector, which would read as a failed reset.
        done = bool(await self.engine.reset_prefix_cache(
            reset_connector=self.cfg.engine.kv_offload.enabled))
        if done:
            for mirror, mark in zip(self.kv_mirrors, marks, strict=True):
                mirror.reset(mark)
        return done

    async def _openai(self) -> Any:
        """vLLM's OpenAI serving layer over this engine, built on first use (the router's
        first probe): vLLM builds it with async calls, and Serve constructs replicas
        synchronously."""
        if self._openai_layer is not None:
            return self._openai_layer
        async with self._openai_lock:
            if self._openai_layer is None:
                from rayattn.config.plan import frontend_kwargs
                from rayattn.engine.openai_layer import OpenAILayer

                frontend = frontend_kwargs(self.cfg)
                if self.plan.adapters:
                    frontend["lora_modules"] = lora_modules(self.plan.adapters,
                                                            self.cfg.model.name)
                self._openai_layer = await OpenAILayer.create(
                    self.engine, self.plan.engine_kwargs, frontend,
                    {"engine": self.replica_id, "rank": self.rank,
                     "pid": os.getpid()},
                    self.metrics, self._inflight_report, self.tracing)
                patches.log_applied(f"engine {self.replica_id}",
                                    [patches.RENDER_ONCE]
                                    if self._openai_layer.takes_rendered else [])
            return self._openai_layer

    async def models(self, target: str | None = None) -> dict[str, Any]:
        """`/v1/models` as vLLM serves it."""
        self._pinned(target)
        return await (await self._openai()).list_models()

    async def serve(self, target: str | None, req: OpenAIRequest) -> AsyncIterator[Reply]:
        """One OpenAI request through vLLM's serving layer, counted in this engine's
        in-flight requests per sending router while it runs."""
        self._pinned(target)
        if self.engine.errored:
            # Distinct from vLLM's EngineDeadError for requests it was running: the router
            # retries this one elsewhere, and not those.
            raise EngineDown(f"engine of {self.replica_id} is dead")
        if req.engine_rank is not None and not 0 <= req.engine_rank < self.dp_ranks:
            # A replica keeps its ranks for life (a replacement has a new id), so the router
            # asked for a rank it never saw: its own bug, answered 500, not retried.
            raise RuntimeError(f"engine of {self.replica_id} has no DP rank "
                               f"{req.engine_rank}")
        layer = await self._openai()
        key = (req.engine_rank, req.origin)
        self._inflight[key] += 1
        self._inflight_seq += 1
        try:
            async for item in layer.serve(req):
                yield item
        finally:
            self._inflight[key] -= 1
            self._inflight_seq += 1
            if self._inflight[key] <= 0:
                del self._inflight[key]


AUTOSCALED_TTL_S = 5.0
"""A live change of the engine deployment's autoscaling bounds reaches routers within this
(plus a probe period), while the controller is asked for this deployment's config once per
replica per period (integrations/serve_private.py: serve_autoscales)."""

DRAIN_MARGIN_S = 3.0
"""Of serve.graceful_shutdown_timeout_s, what the direct calls' drain leaves to Serve: its
own drain loop (graceful_shutdown_wait_loop_s, 2 s) ran first, and the engine must stop
before the controller kills the replica."""


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _classify(e: BaseException) -> wire.Raised:
    """An exception of this replica's `serve` as the direct transport carries it."""
    return wire.raised_of(e, compat.client_error_types(), (Misrouted, EngineDown),
                          engine_crash_types())


def _serve_identity() -> tuple[str, int]:
    """This replica's id (what the router calls it) and its rank among the deployment's
    replicas (the DP rank in metrics; Serve keeps ranks 0..n-1 as replicas come and go)."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        return ctx.replica_tag, int(ctx.rank.rank) if ctx.rank is not None else 0
    except Exception:  # constructed outside Serve (bench/metrics_overhead.py)
        return f"engine-{os.getpid()}", 0
