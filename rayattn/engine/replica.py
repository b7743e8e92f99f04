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
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from rayattn import compat, logs
from rayattn.config.loader import parse_args
from rayattn.config.plan import build_plan, frontend_kwargs
from rayattn.config.schema import RayAttnConfig
from rayattn.engine import cpu_priority, reaper, wire
from rayattn.engine.direct_server import DirectServer
from rayattn.engine.inflight import InflightCounts
from rayattn.engine.kv_mirror import node_ip
from rayattn.engine.load_signals import LoadSignals
from rayattn.engine.openai_layer import LazyOpenAILayer, OpenAILayer
from rayattn.engine.protocol import (
    DirectAddress,
    EngineDown,
    EngineInfo,
    Misrouted,
    OpenAIRequest,
    RankInfo,
    Reply,
    check_target,
)
from rayattn.integrations import patches
from rayattn.integrations.devices import engine_device_info
from rayattn.integrations.vllm_engine import engine_crash_types, prefill
from rayattn.integrations.vllm_openai import lora_modules
from rayattn.metrics import tracing
from rayattn.metrics.engine_metrics import EngineMetrics
from rayattn.routing.kv_events import Snapshot

log = logging.getLogger("rayattn.engine")

OPERATOR_RPC_PATH = os.environ.get("VLLM_RPC_BASE_PATH")
"""vLLM's IPC directory as the process started (the node's or runtime_env's), read before
any replica here set its own."""


class EngineReplica:
    def __init__(self, args: dict[str, Any], metrics_enabled: bool = True) -> None:
        logs.setup()
        cfg = parse_args(args)
        plan = build_plan(cfg, prepare_model=True)
        # The engine core is a child process: it inherits this environment, including the
        # PYTHONHASHSEED that makes its block hashes match the router's.
        os.environ.update(plan.env)
        for warning in (compat.support_warning(), cpu_priority.warning()):
            if warning is not None:
                log.warning(warning)
        # vLLM-version/install fixes (flashinfer sampler, TCPStore port window)
        compat.apply_engine_env(os.environ, cfg.platform.kind, plan.engine_kwargs)
        # The engine's run-time files, vLLM's IPC sockets between this process and its engine
        # core and the KV-event sockets, in one directory of this user's (0700) instead of
        # the system's temporary one, where every engine start left three sockets and a
        # directory that a killed process never removes. An operator's own path stays.
        self.run_dir = tempfile.mkdtemp(prefix="rayattn-engine-")
        if OPERATOR_RPC_PATH is None and "VLLM_RPC_BASE_PATH" not in cfg.engine.env \
                and rpc_path_is_local(cfg):
            os.environ["VLLM_RPC_BASE_PATH"] = self.run_dir
        # Engine processes must not outlive this replica (ray stop --force, SIGKILL): a
        # watcher in its own session ends them when this process is gone, then removes the
        # run directory.
        reaper.start_for_current_process(self.run_dir)
        self.replica_id, self.rank = serve_identity()
        # The first of the start's milestones in the log (then vLLM's own, then "ready"):
        # what came before is Ray's worker start, Ray's and rayattn's imports, the plan and
        # the reaper's start.
        log.info("engine %s starting (pid %d): loading vLLM", self.replica_id, os.getpid())
        if cfg.engine.prestart_core:
            patches.prestart_engine_core()
        # vLLM loads here, in the replica, not where Serve builds the application.
        from rayattn.engine import startup

        # The run-time patches this engine applied, logged in one line once its serving
        # layer is built.
        self._patches = ([patches.PRESTARTED_ENGINE_CORE] if cfg.engine.prestart_core
                         and patches.launch_engine_cores_prestarted() else [])

        self.cfg, self.plan = cfg, plan
        self.tracing = tracing.make(cfg.tracing, "engine")
        self.metrics = (EngineMetrics(cfg.model.name, plan.backend.name, self.replica_id,
                                      self.rank) if metrics_enabled else None)
        self.load_signals = LoadSignals()
        kwargs, loggers = startup.observed_kwargs(plan, self.metrics, self.load_signals)
        self.dp_ranks = int(kwargs.get("data_parallel_size", 1))
        self.kv_mirrors = startup.kv_event_mirrors(plan, kwargs, self.dp_ranks,
                                                   self.run_dir)
        self.engine, startup_s = startup.start_engine(kwargs, loggers)
        self._facts = startup.engine_facts(self.engine, self.replica_id, plan, startup_s)
        self.inflight = InflightCounts()
        self.openai = LazyOpenAILayer(self._build_openai)
        self._direct: DirectServer | None = None
        self._facts["engine_pids"] = sorted(reaper.descendants(os.getpid()))
        log.info("engine %s ready: %s", self.replica_id, self._facts)

    def _pinned(self, target: str | None) -> None:
        check_target(target, self.replica_id)

    def _runnable(self, target: str | None, engine_rank: int | None) -> None:
        """A call for this replica's engine, on one of its DP ranks, can run here."""
        self._pinned(target)
        if self.engine.errored:
            # Distinct from vLLM's EngineDeadError for requests it was running: the router
            # retries this one elsewhere, and not those.
            raise EngineDown(f"engine of {self.replica_id} is dead")
        if engine_rank is not None and not 0 <= engine_rank < self.dp_ranks:
            # A replica keeps its ranks for life (a replacement has a new id), so the router
            # asked for a rank it never saw: its own bug, answered 500, not retried.
            raise RuntimeError(f"engine of {self.replica_id} has no DP rank {engine_rank}")

    async def info(self, target: str | None) -> EngineInfo:
        """Engine facts the router needs (KV capacity in blocks, block size) plus liveness."""
        self._pinned(target)
        await self.engine.check_health()
        layer = await self.openai.get()
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
        self.rank = serve_identity()[1]
        devices = await engine_device_info(self)
        # vLLM sums the ranks' capacities; the ranks are configured alike.
        per_rank = self._facts["num_gpu_blocks"] // self.dp_ranks
        ranks = [RankInfo(None, None, per_rank, self.inflight.of(r))
                 for r in range(self.dp_ranks)]
        for rank, mirror in zip(ranks, self.kv_mirrors, strict=False):
            rank.kv_events, rank.kv_events_key = mirror.endpoint, mirror.server_key.decode()
        return EngineInfo(**self._facts, rank=self.rank, devices=devices["devices"],
                          ranks=ranks,
                          adapters=layer.adapters_served(),
                          placement_group=devices["placement_group"],
                          worker_placement_groups=devices["worker_placement_groups"],
                          unfinished=self.engine.output_processor.get_num_unfinished_requests(),
                          direct=direct,
                          **self.inflight.report())

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
                async def drain_then_close() -> None:
                    try:
                        await direct.drain(max(0.0, self.cfg.serve.graceful_shutdown_timeout_s
                                               - DRAIN_MARGIN_S))
                    finally:
                        self._close()
                return drain_then_close()
        self._close()
        return None

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
        # At once, not at the watcher's next look at this process.
        run_dir = getattr(self, "run_dir", None)
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaler asks every few seconds (rayattn/engine/scaling_policy.py reads
        the answers)."""
        return self.load_signals.read()

    async def check_health(self) -> None:
        # Serve calls this periodically; raising makes Serve replace the replica. A live
        # actor with a dead engine core must count as unhealthy.
        await self.engine.check_health()

    async def kv_snapshot(self, target: str | None, rank: int = 0) -> Any:
        """The blocks DP rank `rank` of this engine caches now and the event sequence number
        that reflects (routers resync their view of that rank from it)."""
        self._pinned(target)
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
        return await (await self.openai.get()).load_adapter(name, path)

    async def unload_adapter(self, target: str | None, name: str) -> Reply:
        self._pinned(target)
        return await (await self.openai.get()).unload_adapter(name)

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

    async def prefill(self, target: str | None, token_ids: list[int],
                      engine_rank: int | None = None, cache_salt: str | None = None) -> int:
        """Compute and cache the KV of `token_ids` (on DP rank `engine_rank`): routers warm
        a joining engine with the prefixes many conversations share, and prefill a leaving
        engine's conversations where their next turns will go (routing/warm_plan.py).
        Returns the tokens it found cached already."""
        self._runnable(target, engine_rank)
        with self.inflight.counting(engine_rank, ""):  # no router's own request
            return await prefill(self.engine, token_ids, f"warm-{uuid.uuid4().hex}",
                                 engine_rank, cache_salt)

    async def _build_openai(self) -> OpenAILayer:
        frontend = frontend_kwargs(self.cfg)
        if self.plan.adapters:
            frontend["lora_modules"] = lora_modules(self.plan.adapters, self.cfg.model.name)
        layer = await OpenAILayer.create(
            self.engine, self.plan.engine_kwargs, frontend,
            {"engine": self.replica_id, "rank": self.rank, "pid": os.getpid()},
            self.metrics, self.inflight.report, self.tracing)
        patches.log_applied(f"engine {self.replica_id}", [
            *self._patches, *([patches.RENDER_ONCE] if layer.takes_rendered else [])])
        return layer

    async def models(self, target: str | None = None) -> dict[str, Any]:
        """`/v1/models` as vLLM serves it."""
        self._pinned(target)
        return await (await self.openai.get()).list_models()

    async def serve(self, target: str | None, req: OpenAIRequest) -> AsyncIterator[Reply]:
        """One OpenAI request through vLLM's serving layer, counted in this engine's
        in-flight requests per sending router while it runs."""
        self._runnable(target, req.engine_rank)
        layer = await self.openai.get()
        with self.inflight.counting(req.engine_rank, req.origin):
            async for item in layer.serve(req):
                yield item


DRAIN_MARGIN_S = 3.0
"""Of serve.graceful_shutdown_timeout_s, what the direct calls' drain leaves to Serve: its
own drain loop (graceful_shutdown_wait_loop_s, 2 s) ran first, and the engine must stop
before the controller kills the replica."""


def rpc_path_is_local(cfg: RayAttnConfig) -> bool:
    """Whether every process vLLM gives the engine's IPC path runs on this node: vLLM's Ray
    executor (several devices per rank) copies VLLM_* variables to its workers, which a
    placement other than STRICT_PACK may put on another node, where this directory is not."""
    return cfg.parallelism.devices_per_rank == 1 or cfg.serve.placement_strategy == "STRICT_PACK"


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


def serve_identity() -> tuple[str, int]:
    """This replica's id (what the router calls it) and its rank among the deployment's
    replicas (the DP rank in metrics; Serve keeps ranks 0..n-1 as replicas come and go)."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        return ctx.replica_tag, int(ctx.rank.rank) if ctx.rank is not None else 0
    except Exception:  # constructed outside Serve (bench/metrics_overhead.py)
        return f"engine-{os.getpid()}", 0
