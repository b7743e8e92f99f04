"""Where vLLM publishes an engine's KV events: one ZMQ endpoint per DP rank, derived from the
configured one by vLLM's own offsetting (the engine replica subscribes where each rank binds;
rayattn/engine/kv_mirror.py)."""

from __future__ import annotations

IPC_EVENT_MARK = "inproc"
"""In the names of rayattn's IPC event sockets: vLLM derives each DP rank's endpoint from the
configured one (`dp_rank_endpoint`) by port for tcp and by a name suffix only for endpoints
it takes for in-process ones, which it recognises by this word."""


def dp_rank_endpoint(endpoint: str, rank: int) -> str:
    """Where DP rank `rank` of an engine publishes the KV events configured at `endpoint`:
    vLLM's own offsetting, so the engine replica subscribes where each rank binds."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    return ZmqEventPublisher.offset_endpoint_port(endpoint, rank) or endpoint
