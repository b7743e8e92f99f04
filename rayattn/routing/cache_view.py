"""The router's picture of every engine's prefix cache: one index, fed either by the engines'
KV events (`events`) or by the router's own decisions (`predicted`).

Replicas join with an empty view (a new engine's cache is empty; with events, the snapshot
fills it) and leave with theirs forgotten.
"""

from __future__ import annotations

import logging
from typing import Any

from rayattn.routing.kv_events import EventFeed, Snapshot
from rayattn.routing.prefix_index import EventIndex, PrefixIndex

log = logging.getLogger("rayattn.router")


class _ReplicaSink:
    """Events of one engine applied to the shared index."""

    def __init__(self, index: EventIndex, replica: str) -> None:
        self.index, self.replica = index, replica

    def stored(self, keys: list[int]) -> None:
        self.index.stored(self.replica, keys)

    def removed(self, keys: list[int]) -> None:
        self.index.removed(self.replica, keys)

    def cleared(self) -> None:
        self.index.cleared(self.replica)


class CacheView:
    def __init__(self, mode: str, speculative_ttl_s: float = 30.0) -> None:
        self.mode = mode
        self.index: PrefixIndex = (EventIndex(speculative_ttl_s) if mode == "events"
                                   else PrefixIndex())
        self.feeds: dict[str, EventFeed] = {}

    def join(self, name: str, info: dict[str, Any], handle: Any) -> None:
        self.leave(name)
        self.index.add_replica(name, info.get("num_gpu_blocks", 0))
        if self.mode != "events":
            return
        endpoint = info.get("kv_events")
        if not endpoint:
            log.error("engine %s publishes no KV events (engine.kv_events off?): the router "
                      "only sees what it sent there, for router.speculative_ttl_s", name)
            return
        index = self.index
        assert isinstance(index, EventIndex)

        async def snapshot() -> Snapshot:
            return await handle.kv_snapshot.remote()

        feed = EventFeed(endpoint, _ReplicaSink(index, name), snapshot,
                         lambda keys: index.reset(name, keys), name)
        self.feeds[name] = feed
        feed.start()

    def leave(self, name: str) -> None:
        feed = self.feeds.pop(name, None)
        if feed is not None:
            feed.stop()
        self.index.remove_replica(name)

    def stats(self, name: str) -> dict[str, Any]:
        out: dict[str, Any] = {"blocks": self.index.size(name)}
        feed = self.feeds.get(name)
        if feed is not None:
            out.update(seq=feed.last_seq, resyncs=feed.resyncs, batches=feed.batches)
        if isinstance(self.index, EventIndex):
            out["speculative"] = self.index.speculative(name)
        return out
