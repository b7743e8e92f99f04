"""vLLM's KV cache events (ZMQ PUB: BlockStored / BlockRemoved / AllBlocksCleared), turned
into updates of a cache view.

Wire format (vllm.distributed.kv_events.ZmqEventPublisher): multipart (topic, 8-byte
big-endian sequence number, msgpack KVEventBatch). Block hashes arrive as the low 64 bits of
vLLM's block hash, which is exactly the router's index key (rayattn.routing.hashing.to_key).

Two consumers use this module: each engine replica mirrors its own engine's cache (so a
router can ask it for a full snapshot: rayattn/engine/kv_mirror.py), and every router replica
follows every engine's stream live (rayattn/server/kv_feeds.py), resynchronising from that
snapshot on start, on a sequence gap and after an engine restart.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import msgspec

from rayattn.routing.hashing import to_key

log = logging.getLogger("rayattn.kv_events")

Tier = Literal["gpu", "cpu"]
"""Where a cached block lives: the engine's own KV cache (`gpu`, what vLLM's block pool
publishes without a medium) or the host-memory tier of vLLM's offloading connector (`cpu`),
from which a prefix is reloaded instead of prefilled."""

# vLLM's event medium → tier. Other media (vLLM's storage tiers) are not indexed: a prefix
# there is priced as cold, which errs towards the replica that holds it in memory.
_TIERS: dict[str | None, Tier] = {None: "gpu", "GPU": "gpu", "gpu": "gpu",
                                   "CPU": "cpu", "cpu": "cpu"}


class CacheSink(Protocol):
    def stored(self, keys: list[int], tier: Tier) -> None: ...
    def removed(self, keys: list[int], tier: Tier) -> None: ...
    def cleared(self) -> None:
        """Every tier emptied (AllBlocksCleared: rayattn resets an engine's prefix cache
        and its connector together; vLLM publishes nothing for the host tier's reset)."""


def decoder() -> Any:
    from vllm.distributed.kv_events import KVEventBatch  # vLLM: only a router with KV events

    return msgspec.msgpack.Decoder(type=KVEventBatch)


def apply_batch(batch: Any, sink: CacheSink) -> None:
    from vllm.distributed.kv_events import (  # vLLM: only a router with KV events
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
    )

    # The offloading connector's events carry the real block hashes of what it stored
    # (vLLM's self-describing events, which rayattn's plan turns on; without them, its
    # placeholder names a chunk by its last block's hash, the same key while offloaded
    # chunks are one block, as rayattn configures them).
    for ev in batch.events:
        if isinstance(ev, BlockStored | BlockRemoved):
            tier = _TIERS.get(getattr(ev, "medium", None))
            if tier is None:
                continue
            keys = [to_key(h) for h in ev.block_hashes]
            if isinstance(ev, BlockStored):
                sink.stored(keys, tier)
            else:
                sink.removed(keys, tier)
        elif isinstance(ev, AllBlocksCleared):
            sink.cleared()


@dataclass
class Snapshot:
    seq: int
    """Sequence number of the last batch applied (-1: none yet)."""
    keys: list[int]
    """Blocks in the engine's own (GPU) cache."""
    offloaded: list[int] = field(default_factory=list)
    """Blocks in its host-memory tier, each as often as it is announced there now (vLLM
    may announce a block in several offloaded chunks; it leaves with the last)."""
