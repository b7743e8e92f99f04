"""vLLM's KV cache events (ZMQ PUB: BlockStored / BlockRemoved / AllBlocksCleared), turned
into updates of a cache view.

Wire format (vllm.distributed.kv_events.ZmqEventPublisher): multipart (topic, 8-byte
big-endian sequence number, msgpack KVEventBatch). Block hashes arrive as the low 64 bits of
vLLM's block hash, which is exactly the router's index key (rayattn.routing.hashing.to_key).

Two consumers use this module: each engine replica mirrors its own engine's cache (so a
router can ask it for a full snapshot), and every router replica follows every engine's
stream live (`EventFeed`), resynchronising from that snapshot on start, on a sequence gap and
after an engine restart, so an index is never stale for longer than one resync.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
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


class EventFeed:
    """Follows one engine's event stream into `sink` (a router's view of that engine).

    Order of operations on (re)sync: subscribe first, then fetch the engine replica's
    snapshot (its mirror's state at sequence S), drop buffered batches ≤ S, apply the rest.
    A batch whose sequence is not last+1 means batches were lost: resync."""

    def __init__(self, endpoint: str, sink: CacheSink, snapshot: Callable[[], Awaitable[Snapshot]],
                 reset: Callable[[list[int]], None], name: str) -> None:
        self.endpoint, self.sink, self._snapshot, self._reset = endpoint, sink, snapshot, reset
        self.name = name
        self.last_seq = -1
        self._seen = -1
        """Highest sequence number received (a resync must reach at least this)."""
        self.resyncs = 0
        self.batches = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            from rayattn.routing.replica_set import detached

            self._task = detached(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        dec = decoder()
        while True:
            sock = ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.connect(self.endpoint)
            try:
                await self._follow(sock, dec)
            except asyncio.CancelledError:
                sock.close()
                raise
            except Exception:
                log.exception("KV event feed %s failed; resyncing", self.name)
                await asyncio.sleep(1.0)
            sock.close()

    async def _follow(self, sock: Any, dec: Any) -> None:
        # Give the subscription a moment to reach the publisher (ZMQ's slow joiner), then
        # take the snapshot; anything published meanwhile is buffered in the socket.
        await asyncio.sleep(0.05)
        snap = await self._snapshot()
        for _ in range(100):
            # After a gap the mirror may still be catching up (it fills its own gaps from
            # vLLM's replay buffer): wait until it reflects what this feed already saw.
            if snap.seq >= self._seen:
                break
            await asyncio.sleep(0.1)
            snap = await self._snapshot()
        self._reset(snap.keys)
        self.last_seq = snap.seq
        self.resyncs += 1
        while True:
            parts = await sock.recv_multipart()
            if len(parts) != 3:
                continue
            seq = int.from_bytes(parts[1], "big")
            self._seen = max(self._seen, seq)
            if seq <= self.last_seq:
                continue  # already in the snapshot
            if seq != self.last_seq + 1:
                log.warning("KV events of %s: gap (%d after %d); resyncing", self.name, seq,
                            self.last_seq)
                return
            apply_batch(dec.decode(parts[2]), self.sink)
            self.last_seq = seq
            self.batches += 1
