"""A typed picture of what a routing core knows, for /health and the simulator's reports."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rayattn.routing.kv_budget import KVBudget
from rayattn.routing.load import LoadTracker
from rayattn.routing.prefix_index import CacheIndex


@dataclass
class ReplicaView:
    """The core's picture of one member, for /health and the simulator's reports."""

    inflight: int
    local: int
    pending_prefill_tokens: int
    blocks: int
    speculative_blocks: int | None
    offloaded_blocks: int = 0
    """Blocks of its host-memory KV tier (vLLM's offloading connector)."""
    admission_fill: float = 0.0
    """The fraction of its KV cache cache-pressure admission admits up to now from this
    router (its fill × this router's share of the cache)."""


@dataclass
class CoreSnapshot:
    policy: str
    index_mode: str
    block_size: int
    routable: dict[str, ReplicaView]
    regret_tokens: dict[str, int]
    """By decision reason: tokens recomputed that another replica held (decision_log.py)."""
    session_moves: dict[str, int]
    """By decision reason: conversations sent elsewhere than their previous turn."""


def replica_views(routable: Mapping[str, int], load: LoadTracker, index: CacheIndex,
                  kv: KVBudget) -> dict[str, ReplicaView]:
    """Each member of `routable` as the load view, the index and the KV budget see it."""
    return {n: ReplicaView(load.inflight[n], load.local.get(n, 0),
                           load.pending_prefill.get(n, 0), index.size(n),
                           index.speculative(n), index.offloaded(n),
                           kv.fill_of(n) * kv.share)
            for n in routable}

