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
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger("rayattn.kv_events")

# Offloaded copies (vLLM's CPU offloading connector) are not what the engine's prefix cache
# can hit for free; only the primary cache counts.
_PRIMARY_MEDIA = (None, "GPU", "gpu")


class CacheSink(Protocol):
    def stored(self, keys: list[int]) -> None: ...
    def removed(self, keys: list[int]) -> None: ...
    def cleared(self) -> None: ...


def decoder() -> Any:
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    return msgspec.msgpack.Decoder(type=KVEventBatch)


def apply_batch(batch: Any, sink: CacheSink) -> None:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    from rayattn.routing.hashing import to_key

    for ev in batch.events:
        if isinstance(ev, BlockStored):
            if getattr(ev, "medium", None) in _PRIMARY_MEDIA:
                sink.stored([to_key(h) for h in ev.block_hashes])
        elif isinstance(ev, BlockRemoved):
            if getattr(ev, "medium", None) in _PRIMARY_MEDIA:
                sink.removed([to_key(h) for h in ev.block_hashes])
        elif isinstance(ev, AllBlocksCleared):
            sink.cleared()


@dataclass
class Snapshot:
    seq: int
    """Sequence number of the last batch applied (-1: none yet)."""
    keys: list[int]
