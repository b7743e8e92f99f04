"""What an engine replica starts: vLLM's AsyncLLM with rayattn's observers (per-step
metrics, device reports) and, where routers follow the cache, the KV event mirrors each DP
rank publishes to; and the facts the router is told about the started engine."""

from __future__ import annotations

import os
import time
from typing import Any

from vllm.config import KVEventsConfig
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

from rayattn import compat
from rayattn.config.plan import Plan
from rayattn.engine.kv_mirror import TOPIC, KVMirror, node_ip, private_ipc_endpoints
from rayattn.engine.load_signals import LoadSignals, make_signals_logger_factory
from rayattn.integrations.devices import device_report_kwargs
from rayattn.integrations.vllm_engine import engine_args
from rayattn.integrations.vllm_kv_events import dp_rank_endpoint
from rayattn.metrics.engine_metrics import EngineMetrics, make_step_logger_factory


def observed_kwargs(plan: Plan, metrics: EngineMetrics | None, signals: LoadSignals
                    ) -> tuple[dict[str, Any], list[Any]]:
    """The plan's engine arguments with rayattn's observers added, and the stat loggers."""
    kwargs = dict(plan.engine_kwargs)
    loggers: list[Any] = [RayPrometheusStatLogger, make_signals_logger_factory(signals)]
    if metrics is not None:
        kwargs.update(compat.step_metrics_kwargs(metrics))
        loggers.append(make_step_logger_factory(metrics))
    kwargs.update(device_report_kwargs(plan.config.platform.kind, kwargs))
    return kwargs, loggers


def kv_event_mirrors(plan: Plan, kwargs: dict[str, Any], dp_ranks: int,
                     run_dir: str | None = None) -> list[KVMirror]:
    """One mirror per DP rank (each rank's scheduler publishes its own cache's events),
    subscribed before the engine publishes anything: routers resync from it. Sets the
    engine's KV events configuration in `kwargs`; none where routers do not follow events.
    The sockets' directory lies in `run_dir` (the replica's) where given."""
    engine = plan.config.engine
    if not (engine.kv_events and engine.enable_prefix_caching):
        return []
    # vLLM's sockets carry every tenant's token ids: IPC, in a private directory; routers
    # read the mirror's authenticated relay instead (kv_mirror.py).
    ipc_dir, pub, replay = private_ipc_endpoints(run_dir)
    kwargs["kv_events_config"] = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=pub,
        replay_endpoint=replay, topic=TOPIC)
    # The directory goes with rank 0's mirror, the last one closed.
    return [KVMirror(dp_rank_endpoint(pub, r), dp_rank_endpoint(replay, r), node_ip(),
                     ipc_dir if r == 0 else None, rank=r)
            for r in range(dp_ranks)]


def start_engine(kwargs: dict[str, Any], loggers: list[Any]) -> tuple[AsyncLLM, float]:
    """The engine, and how long its start took."""
    t0 = time.monotonic()
    engine = AsyncLLM.from_engine_args(engine_args(kwargs), stat_loggers=loggers)
    return engine, round(time.monotonic() - t0, 2)


def engine_facts(engine: AsyncLLM, replica_id: str, plan: Plan,
                 startup_s: float) -> dict[str, Any]:
    """What the router is told of the started engine (EngineInfo's fixed fields)."""
    vc, offload = engine.vllm_config, plan.config.engine.kv_offload
    return {
        "replica": replica_id,
        "pid": os.getpid(),
        "backend": plan.backend.name,
        "block_size": vc.cache_config.block_size,
        "num_gpu_blocks": int(vc.cache_config.num_gpu_blocks or 0),
        "max_model_len": vc.model_config.max_model_len,
        "max_num_seqs": vc.scheduler_config.max_num_seqs,
        "startup_s": startup_s,
        "host_kv_gib": offload.size_gib if offload.enabled else 0.0,
    }
