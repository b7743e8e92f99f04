"""Pins: vLLM's KV events as the engine replica configures and follows them
(rayattn/integrations/vllm_kv_events.py, rayattn/engine/replica.py, rayattn/engine/kv_mirror.py,
rayattn/routing/kv_events.py)."""

from __future__ import annotations

from rayattn.integrations.vllm_kv_events import IPC_EVENT_MARK, dp_rank_endpoint
from tests.unit.integrations import pins


def test_vllm_offsets_each_dp_ranks_endpoint():
    from vllm.distributed.kv_events import ZmqEventPublisher

    pins.params(ZmqEventPublisher.offset_endpoint_port, "endpoint", "data_parallel_rank",
                leading=True, user="rayattn/integrations/vllm_kv_events.py dp_rank_endpoint")
    ipc = f"ipc:///tmp/x/{IPC_EVENT_MARK}-pub"
    assert dp_rank_endpoint(ipc, 0) == ipc
    assert dp_rank_endpoint(ipc, 1) != ipc, (
        f"{pins.version('vllm')}: rank 1 of {ipc} is the same endpoint; vLLM no longer "
        f"derives IPC endpoints by the {IPC_EVENT_MARK!r} word (kv_mirror.py names them so)")
    assert dp_rank_endpoint("tcp://*:5557", 1) == "tcp://*:5558"


def test_the_events_carry_block_hashes_and_their_tier():
    from vllm.distributed import kv_events

    user = "rayattn/routing/kv_events.py apply_batch"
    for cls in (kv_events.BlockStored, kv_events.BlockRemoved):
        pins.attrs(cls, "block_hashes", "medium", user=user)
    pins.attrs(kv_events, "AllBlocksCleared", "KVEventBatch", user=user)
    pins.attrs(kv_events.KVEventBatch, "events", user=user)


def test_the_events_config_takes_what_the_replica_sets():
    from vllm.config import KVEventsConfig

    pins.attrs(KVEventsConfig, "enable_kv_cache_events", "publisher", "endpoint",
               "replay_endpoint", "topic", user="rayattn/engine/replica.py EngineReplica")
