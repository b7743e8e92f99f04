"""The router's live subscriptions to every engine's KV events (ZMQ), written into the
routing core's index. With `router.index: predicted` there are none: the index is the
router's own guess.

Replicas join with an empty view (a new engine's cache is empty; the snapshot fills it) and
leave with theirs forgotten (the core drops the blocks; here the subscription ends).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from rayattn.engine.kv_mirror import CLEARED_TOPIC, CurveKeys, subscriber
from rayattn.routing.core import RoutingCore
from rayattn.routing.kv_events import CacheSink, Snapshot, Tier, apply_batch, decoder
from rayattn.routing.prefix_index import EventIndex
from rayattn.server.background import detached

log = logging.getLogger("rayattn.kv_events")
_CLEARED = CLEARED_TOPIC.encode()

STALE_S = 10.0
"""How long a feed may stay silent after its engine finished a request that must have
stored new blocks, before the router stops trusting it and resyncs."""
SYNC_GRACE_S = 15.0
"""How long a starting router waits for its feeds' first snapshots before it takes traffic
(and answers /health with 503 meanwhile): routed before that, a conversation's later turn
finds no history and is placed cold. A feed that cannot sync (its engine does not answer the
snapshot call) holds the router back no longer than this."""
HANDSHAKE_S = 2.0
"""How long a (re)sync waits for the subscription's connection before taking the snapshot
anyway (a gap found later resyncs)."""


class FeedSink(CacheSink, Protocol):
    def reset(self, snap: Snapshot) -> None:
        """Replace the view with a snapshot's blocks (a feed's resync)."""


class _ReplicaSink:
    """Events of one engine applied to the core's current index (looked up per batch: a
    live index change replaces it)."""

    def __init__(self, core: RoutingCore, replica: str) -> None:
        self.core, self.replica = core, replica

    def _index(self) -> EventIndex | None:
        index = self.core.index
        return index if isinstance(index, EventIndex) else None

    def stored(self, keys: list[int], tier: Tier) -> None:
        if (index := self._index()) is not None:
            index.stored(self.replica, keys, tier)

    def removed(self, keys: list[int], tier: Tier) -> None:
        if (index := self._index()) is not None:
            index.removed(self.replica, keys, tier)

    def cleared(self) -> None:
        if (index := self._index()) is not None:
            index.cleared(self.replica)

    def reset(self, snap: Snapshot) -> None:
        if (index := self._index()) is not None:
            index.reset(self.replica, snap.keys, snap.offloaded)


class KVFeeds:
    """One EventFeed per engine replica in the core's membership, when the index follows
    events."""

    def __init__(self, core: RoutingCore) -> None:
        self.core = core
        self.feeds: dict[str, EventFeed] = {}
        self.keys = CurveKeys.new()
        """This router's key pair: engines admit its public key (kv_subscribe), and the
        secret never leaves this process."""
        self.hold_until = time.monotonic() + SYNC_GRACE_S
        """Until when feeds still syncing hold the router's start back (`hold`)."""
        self.started = False
        """The router has taken traffic (`release`): no feed holds it back any more."""

    def join(self, name: str, endpoint: str | None, server_key: str | None,
             handle: Any, rank: int = 0) -> None:
        """Follow target `name`: DP rank `rank` of the engine replica behind `handle`."""
        self.leave(name)
        if self.core.settings.index != "events":
            return
        if not endpoint:
            log.error("engine %s publishes no KV events (engine.kv_events off?): the router "
                      "only sees what it sent there, for router.speculative_ttl_s", name)
            return

        async def snapshot() -> Snapshot:
            return await handle.kv_snapshot.remote(rank)

        async def admit() -> None:
            await handle.kv_subscribe.remote(self.keys.public.decode())

        feed = EventFeed(endpoint, _ReplicaSink(self.core, name), snapshot, name,
                         (server_key.encode(), self.keys) if server_key else None, admit)
        self.feeds[name] = feed
        feed.start()

    def leave(self, name: str) -> None:
        feed = self.feeds.pop(name, None)
        if feed is not None:
            feed.stop()

    def stats(self, name: str) -> dict[str, Any]:
        feed = self.feeds.get(name)
        if feed is None:
            return {}
        return {"seq": feed.last_seq, "resyncs": feed.resyncs, "batches": feed.batches,
                "stale": feed.stale, "synced": feed.synced_at is not None}

    def syncing(self) -> list[str]:
        """While the router starts: targets whose feed has not applied its first snapshot,
        i.e. whose view is still empty, for at most SYNC_GRACE_S. Once it has started,
        feeds that join (a new engine, as empty as its view; a reset or a new index that
        resyncs a view it already routed by) hold nothing back."""
        if self.started or time.monotonic() >= self.hold_until:
            return []
        return [n for n, f in self.feeds.items() if f.synced_at is None]

    def hold(self) -> None:
        """The router waits for its feeds now: the grace counts from here (the membership
        and the first probes before it may have taken a while)."""
        self.hold_until = max(self.hold_until, time.monotonic() + SYNC_GRACE_S)

    def release(self) -> None:
        """The router takes traffic from now on."""
        self.started = True

    def expect(self, name: str, since: float) -> None:
        """`name`'s engine finished a request, sent at `since` (monotonic), that filled new
        blocks: their events must have come since, or must come."""
        feed = self.feeds.get(name)
        if feed is not None and feed.expected_since is None and feed.heard_at < since:
            feed.expected_since = time.monotonic()

    def restart_stale(self, stale_s: float = STALE_S) -> list[str]:
        """Resync every feed that stayed silent past `stale_s` while an event was due (a
        publisher restarted under the same endpoint, a connection that silently broke): a
        view nobody updates would otherwise steer routing on a cache that is gone."""
        now, restarted = time.monotonic(), []
        for name, feed in self.feeds.items():
            if feed.expected_since is not None and now - feed.expected_since > stale_s:
                log.warning("KV events of %s silent for %.0f s after requests that stored "
                            "blocks; resyncing", name, now - feed.expected_since)
                feed.stale += 1
                feed.expected_since = None
                feed.stop()
                feed.start()
                restarted.append(name)
        return restarted


class EventFeed:
    """Follows one engine's event stream into `sink` (a router's view of that engine).

    Order of operations on (re)sync: subscribe and wait until the connection's handshake is
    done, then fetch the engine replica's snapshot (its mirror's state at sequence S), drop
    buffered batches ≤ S, apply the rest. A batch whose sequence is not last+1 means batches
    were lost: resync. Without the wait, a subscription still connecting when the snapshot
    is taken (CurveZMQ on busy cores) loses the batches in between, and the router does not
    know until the next batch shows the gap: on a quiet engine, a whole turn later."""

    def __init__(self, endpoint: str, sink: FeedSink,
                 snapshot: Callable[[], Awaitable[Snapshot]], name: str,
                 curve: tuple[bytes, CurveKeys] | None = None,
                 admit: Callable[[], Awaitable[None]] | None = None) -> None:
        self.endpoint, self.sink, self._snapshot = endpoint, sink, snapshot
        self.name = name
        self._curve, self._admit = curve, admit
        self.last_seq = -1
        self._seen = -1
        """Highest sequence number received (a resync must reach at least this)."""
        self.resyncs = 0
        self.batches = 0
        self.stale = 0
        """Times this feed was found silent while events were due, and resynced."""
        self.expected_since: float | None = None
        """Since when an event has been due (KVFeeds.expect); None: none is."""
        self.heard_at = float("-inf")
        """When the last batch (or snapshot) arrived (monotonic)."""
        self.synced_at: float | None = None
        """When the first snapshot was applied (monotonic); None: not yet."""
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = detached(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        # pyzmq comes with vLLM: only a router following KV events needs it.
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        dec = decoder()
        while True:
            sock = None
            try:
                if self._admit is not None:
                    # Before connecting: a handshake with a key not yet admitted is refused.
                    await self._admit()
                sock = subscriber(ctx, self.endpoint, *(self._curve or ()),
                                  connect=False)
                await self._connect(sock)
                await self._follow(sock, dec)
            except asyncio.CancelledError:
                if sock is not None:
                    sock.close()
                raise
            except ConnectionError as e:  # refused: no traceback every second
                log.warning("%s; admitting again", e)
                await asyncio.sleep(1.0)
            except Exception:
                log.exception("KV event feed %s failed; resyncing", self.name)
                await asyncio.sleep(1.0)
            if sock is not None:
                sock.close()

    async def _connect(self, sock: Any) -> None:
        """Connect `sock` and return once its handshake with the publisher is done (or
        after HANDSHAKE_S): from then on what the engine publishes reaches this socket. A
        refused handshake (a key the engine has not admitted, say) raises: the feed admits
        itself again and retries instead of taking a snapshot it would never follow."""
        # pyzmq comes with vLLM: only a router following KV events needs it.
        import zmq
        from zmq.utils.monitor import parse_monitor_message

        failed = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                  | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | failed)
        try:
            sock.connect(self.endpoint)
            try:
                msg = parse_monitor_message(await asyncio.wait_for(mon.recv_multipart(),
                                                                   HANDSHAKE_S))
            except TimeoutError:
                log.warning("KV events of %s: no handshake within %.0f s", self.name,
                            HANDSHAKE_S)
                return
            if msg["event"] & failed:
                raise ConnectionError(f"KV events of {self.name}: handshake refused "
                                      f"(event {msg['event']})")
        finally:
            sock.disable_monitor()
            mon.close()

    async def _follow(self, sock: Any, dec: Any) -> None:
        # The subscription itself follows the handshake (ZMQ's slow joiner): a moment for it
        # to reach the publisher, then the snapshot; what is published meanwhile is buffered
        # in the socket.
        await asyncio.sleep(0.05)
        snap = await self._snapshot()
        for _ in range(100):
            # After a gap the mirror may still be catching up (it fills its own gaps from
            # vLLM's replay buffer): wait until it reflects what this feed already saw.
            if snap.seq >= self._seen:
                break
            await asyncio.sleep(0.1)
            snap = await self._snapshot()
        self.sink.reset(snap)
        self.last_seq = snap.seq
        self.resyncs += 1
        if self.synced_at is None:
            self.synced_at = time.monotonic()
        self.expected_since, self.heard_at = None, time.monotonic()
        while True:
            parts = await sock.recv_multipart()
            if len(parts) != 3:
                continue
            if parts[0] == _CLEARED:
                # The engine was reset: its cache is empty now, before vLLM says so. Said
                # after the batch it names: a snapshot newer than that is past the reset
                # already. (Not a sign of life: a clear carries no request's blocks.)
                if int.from_bytes(parts[1], "big") >= self.last_seq:
                    self.sink.cleared()
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
            self.expected_since, self.heard_at = None, time.monotonic()
