"""The engine replica: a Ray Serve deployment whose replica owns one vLLM AsyncLLM.

Each DP rank is its own single-replica deployment (`engine-<rank>`), so the router addresses
ranks explicitly; see rayattn/app.py for why. The replica's devices are reserved by the
placement group Serve creates from the plan's bundles; vLLM's Ray executor (TP×PP > 1)
schedules its workers into that same group.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from rayattn import compat
from rayattn.config.loader import parse_args
from rayattn.config.plan import build_plan
from rayattn.engine.protocol import Chunk, GenerateRequest

log = logging.getLogger("rayattn.engine")


class EngineReplica:
    def __init__(self, args: dict[str, Any], rank: int, metrics_enabled: bool = True) -> None:
        from rayattn import logs

        logs.setup()
        cfg = parse_args(args)
        plan = build_plan(cfg, prepare_model=True)
        # The engine core is a child process: it inherits this environment, including the
        # PYTHONHASHSEED that makes its block hashes match the router's.
        os.environ.update(plan.env)
        if (outside := compat.support_warning()) is not None:
            log.warning(outside)
        # vLLM-version/install fixes (flashinfer sampler, TCPStore port window)
        compat.apply_engine_env(os.environ, cfg.platform.kind, plan.engine_kwargs)
        # Engine processes must not outlive this replica (ray stop --force, SIGKILL): a
        # watcher in its own session ends them when this process is gone.
        from rayattn.engine import reaper

        self._reaper = reaper.start_for_current_process()

        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

        from rayattn.metrics.engine_metrics import EngineMetrics, make_step_logger_factory

        self.rank = rank
        self.cfg, self.plan = cfg, plan
        self.replica_id = _replica_id(rank)
        self.metrics = (EngineMetrics(cfg.model.name, plan.backend.name, self.replica_id, rank)
                        if metrics_enabled else None)
        kwargs = dict(plan.engine_kwargs)
        loggers: list[Any] = [RayPrometheusStatLogger]
        if self.metrics is not None:
            kwargs.update(compat.step_metrics_kwargs(self.metrics))
            loggers.append(make_step_logger_factory(self.metrics))
        kwargs.update(compat.device_report_kwargs(cfg.platform.kind, kwargs))
        self.kv_mirror = None
        kv_endpoint = None
        if cfg.engine.kv_events and cfg.engine.enable_prefix_caching:
            # Routers follow this engine's cache from its own events; the mirror (subscribed
            # before the engine publishes anything) is what they resync from.
            from vllm.config import KVEventsConfig

            from rayattn.engine.kv_mirror import KVMirror, free_tcp_port, node_ip

            pub, replay = free_tcp_port(), free_tcp_port()
            kwargs["kv_events_config"] = KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{pub}",
                replay_endpoint=f"tcp://*:{replay}", topic="kv")
            self.kv_mirror = KVMirror(pub, replay)
            kv_endpoint = f"tcp://{node_ip()}:{pub}"
        t0 = time.monotonic()
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), stat_loggers=loggers)
        cache = self.engine.vllm_config.cache_config
        self._info = {
            "rank": rank,
            "replica": self.replica_id,
            "pid": os.getpid(),
            "backend": plan.backend.name,
            "block_size": cache.block_size,
            "num_gpu_blocks": int(cache.num_gpu_blocks or 0),
            "max_model_len": self.engine.vllm_config.model_config.max_model_len,
            "startup_s": round(time.monotonic() - t0, 2),
            "kv_events": kv_endpoint,
        }
        self._inflight_by_origin: Counter[str] = Counter()
        # Bumped on every change of the counts: reports taken at different moments (a probe
        # reply, chunks of concurrent requests) reach a router in any order, and it keeps
        # only the newest (routing/load.py).
        self._inflight_seq = 0
        self._info["engine_pids"] = sorted(reaper.descendants(os.getpid(),
                                                              exclude={self._reaper.pid}))
        log.info("engine %s ready: %s", self.replica_id, self._info)

    async def info(self) -> dict[str, Any]:
        """Engine facts the router needs (KV capacity in blocks, block size) plus liveness."""
        await self.engine.check_health()
        if self.metrics is not None:
            # Re-set on every probe: the gauge is only exported once this process's metrics
            # agent is up, which can be after __init__.
            par = self.cfg.parallelism
            self.metrics.info.set(1, {**self.metrics.tags, "tp": str(par.tensor_parallel_size),
                                      "ep": str(par.enable_expert_parallel).lower(),
                                      "platform": self.cfg.platform.kind})
        return {**self._info, **(await compat.engine_device_info(self)),
                "unfinished": self.engine.output_processor.get_num_unfinished_requests(),
                **self._inflight_report()}

    def _inflight_report(self) -> dict[str, Any]:
        """This engine's in-flight requests per sending router, stamped (pid, change
        counter): sent with every probe and on each request's first and final chunk."""
        return {"inflight_by_origin": dict(self._inflight_by_origin),
                "inflight_stamp": (os.getpid(), self._inflight_seq)}

    def __del__(self) -> None:
        # Serve calls this on graceful replica shutdown (redeploy, scale-down, serve
        # shutdown): stop the engine core now rather than leaving it to the watcher.
        if getattr(self, "kv_mirror", None) is not None:
            self.kv_mirror.close()
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

    async def kv_snapshot(self) -> Any:
        """The blocks this engine caches now and the event sequence number that reflects
        (routers resync their view of this engine from it)."""
        from rayattn.routing.kv_events import Snapshot

        return self.kv_mirror.snapshot() if self.kv_mirror is not None else Snapshot(-1, [])

    async def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (benchmarks compare policies from the same cold start)."""
        done = bool(await self.engine.reset_prefix_cache())
        if done and self.kv_mirror is not None:
            self.kv_mirror.reset()
        return done

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Chunk]:
        self._inflight_by_origin[req.origin] += 1
        self._inflight_seq += 1
        try:
            async for chunk in self._generate(req):
                yield chunk
        finally:
            self._inflight_by_origin[req.origin] -= 1
            self._inflight_seq += 1
            if self._inflight_by_origin[req.origin] <= 0:
                del self._inflight_by_origin[req.origin]

    async def _generate(self, req: GenerateRequest) -> AsyncIterator[Chunk]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(**req.sampling, output_kind=RequestOutputKind.DELTA)
        start = time.monotonic()
        first_token_at: float | None = None
        generated = 0
        pending: Chunk | None = None
        last_sent: float | None = None
        # Cancellation of this generator (client gone, router timeout) raises CancelledError
        # inside AsyncLLM.generate, which aborts the request in the engine.
        async for out in self.engine.generate(
            TokensPrompt(prompt_token_ids=req.prompt_token_ids), params, req.request_id
        ):
            comp = out.outputs[0]
            generated += len(comp.token_ids)
            if first_token_at is None and comp.token_ids:
                first_token_at = time.monotonic()
            chunk = Chunk(text=comp.text, token_ids=list(comp.token_ids),
                          finish_reason=comp.finish_reason,
                          prompt_tokens=len(req.prompt_token_ids),
                          num_cached_tokens=out.num_cached_tokens or 0,
                          completion_tokens=generated)
            if out.finished:
                chunk.timings = self._timings(out, start, first_token_at, generated)
                chunk.served_by = {"engine": f"engine-{self.rank}",
                                   "replica": self.replica_id, "pid": os.getpid()}
                if req.log:
                    t = chunk.timings
                    log.info("request %s: %s, prompt %d tokens (%d cached), %d generated, "
                             "ttft %.3fs, e2e %.3fs, finish %s", req.request_id, t["path"],
                             chunk.prompt_tokens, chunk.num_cached_tokens, generated,
                             t["ttft_s"], t["e2e_s"], chunk.finish_reason)
                if self.metrics is not None:
                    try:
                        self.metrics.record_request(chunk.timings["path"], chunk.prompt_tokens,
                                                    chunk.num_cached_tokens, generated,
                                                    chunk.timings)
                    except Exception:  # metrics must never fail a request
                        log.exception("recording request metrics failed")
            # Every yield is a Ray streaming item through this replica, the router and
            # the HTTP proxy: per token that costs more than a GPU decode step. The first
            # token goes at once (TTFT); later deltas are merged until `stream_interval_s`
            # has passed since the last item (the whole answer at once for non-streaming).
            if out.finished or last_sent is None:
                report = self._inflight_report()
                chunk.inflight_by_origin = report["inflight_by_origin"]
                chunk.inflight_stamp = report["inflight_stamp"]
            if pending is None:
                pending = chunk
            else:
                pending.merge(chunk)
            now = time.monotonic()
            if out.finished or last_sent is None or now - last_sent >= req.stream_interval_s:
                yield pending
                pending, last_sent = None, now

    def _timings(self, out: Any, start: float, first: float | None, generated: int) -> dict:
        now = time.monotonic()
        m = out.metrics  # RequestStateStats: *_ts share the engine core's monotonic clock
        ttft = (first or now) - start
        queue = prefill = 0.0
        itl = None
        if m is not None and m.scheduled_ts:
            queue = max(0.0, m.scheduled_ts - m.queued_ts)
            prefill = max(0.0, m.first_token_ts - m.scheduled_ts) if m.first_token_ts else 0.0
            if generated > 1 and m.last_token_ts > m.first_token_ts:
                itl = (m.last_token_ts - m.first_token_ts) / (generated - 1)
        return {"ttft_s": ttft, "prefill_s": prefill, "queue_s": queue, "e2e_s": now - start,
                "itl_s": itl, "path": "extend" if out.num_cached_tokens else "prefill",
                # The prefill's span on the engine core's clock, so routers can measure the
                # engine's throughput over overlapping requests (routing/policies.py).
                "scheduled_ts": m.scheduled_ts if m is not None else 0.0,
                "first_token_ts": (m.first_token_ts or 0.0) if m is not None else 0.0}


def _replica_id(rank: int) -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_tag
    except Exception:
        return f"engine-{rank}"
