"""Pins: vLLM's engine as the engine replica starts, asks and observes it
(rayattn/integrations/vllm_engine.py, rayattn/engine/replica.py, rayattn/engine/observed.py,
rayattn/metrics/engine_metrics.py). What differs by version is tested in
tests/unit/test_compat.py."""

from __future__ import annotations

import dataclasses

import pytest

from rayattn import compat
from tests.unit.integrations import pins

REPLICA = "rayattn/engine/replica.py EngineReplica"


def test_engine_arguments_take_the_config_objects_rayattn_makes():
    from vllm.config import KVTransferConfig, StructuredOutputsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    pins.attrs(AsyncEngineArgs, "structured_outputs_config", "kv_transfer_config",
               "kv_events_config", "worker_extension_cls",
               user="rayattn/integrations/vllm_engine.py engine_args, " + REPLICA)
    assert dataclasses.is_dataclass(StructuredOutputsConfig)
    assert dataclasses.is_dataclass(KVTransferConfig)


def test_a_dead_engine_raises_engine_dead_error():
    from rayattn.integrations.vllm_engine import engine_crash_types

    assert engine_crash_types(), (
        f"{pins.version('vllm')}: no vllm.v1.engine.exceptions.EngineDeadError; "
        "rayattn/server/fleet/replica_set.py tells a crashed engine by it")


def test_async_llm_answers_what_the_replica_asks():
    from vllm.v1.engine.async_llm import AsyncLLM

    pins.params(AsyncLLM.from_engine_args, "stat_loggers", user=REPLICA)
    pins.attrs(AsyncLLM, "errored", "check_health", "shutdown", user=REPLICA)
    pins.params(AsyncLLM.reset_prefix_cache, "reset_connector",
                user=f"{REPLICA}.reset_prefix_cache")
    pins.params(AsyncLLM.collective_rpc, "method", leading=True,
                user="rayattn/integrations/devices.py engine_device_info")
    # Instance attributes; the output processor is undocumented (the replica counts the
    # engine's unfinished requests on it).
    pins.source_says(AsyncLLM.__init__, r"self\.vllm_config\s*=", r"self\.output_processor\s*=",
                     user=f"{REPLICA}.info")
    from vllm.v1.engine.output_processor import OutputProcessor

    pins.attrs(OutputProcessor, "get_num_unfinished_requests", user=f"{REPLICA}.info")


def test_generate_takes_the_dp_rank_the_router_chose():
    from vllm.v1.engine.async_llm import AsyncLLM

    pins.params(AsyncLLM.generate, "data_parallel_rank",
                user="rayattn/engine/observed.py ObservedEngine.generate")


def test_a_requests_output_carries_the_engines_timestamps():
    """Undocumented: RequestOutput.metrics is the engine's RequestStateStats, whose
    timestamps give the per-path timings (queue, prefill, inter-token)."""
    from vllm.v1.metrics.stats import RequestStateStats

    pins.attrs(RequestStateStats, "queued_ts", "scheduled_ts", "first_token_ts",
               "last_token_ts", "first_token_latency",
               user="rayattn/engine/observed.py timings")


def test_stat_loggers_are_called_as_rayattns_step_logger_expects():
    from vllm.v1.metrics.loggers import StatLoggerBase
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger  # noqa: F401

    user = "rayattn/metrics/engine_metrics.py PathStepLogger"
    pins.params(StatLoggerBase.__init__, "vllm_config", "engine_index", leading=True,
                user=user)
    pins.params(StatLoggerBase.record, "scheduler_stats", "iteration_stats",
                "mm_cache_stats", "engine_idx", leading=True, user=user)
    pins.attrs(StatLoggerBase, "log", "log_engine_initialized", user=user)


@pytest.mark.skipif(not compat.has_iteration_details(),
                    reason="this vLLM ships no per-step details (compat.has_iteration_details)")
def test_per_step_details_carry_the_tokens_and_time_of_a_step():
    from vllm.v1.metrics.stats import SchedulerIterationDetails

    pins.attrs(SchedulerIterationDetails, "num_ctx_tokens", "num_generation_tokens",
               "elapsed_ms", "is_dummy",
               user="rayattn/metrics/engine_metrics.py PathStepLogger.record")
