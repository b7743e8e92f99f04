"""KV events end to end, without an engine: vLLM's own ZMQ publisher (on private IPC
sockets) → the engine replica's mirror and its CurveZMQ relay → a router's EventFeed → the
index it routes on."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from rayattn.config.schema import RouterConfig
from rayattn.engine.kv_mirror import CLEARED_TOPIC, KVMirror, private_ipc_endpoints
from rayattn.integrations.vllm_kv_events import dp_rank_endpoint
from rayattn.routing.core import RoutingCore
from rayattn.routing.prefix_index import EventIndex
from rayattn.server.fleet.kv_feeds import KVFeeds


def _stored(keys: list[int]):
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(block_hashes=keys, parent_block_hash=None, token_ids=[0] * 4 * len(keys),
                       block_size=4, lora_id=None, medium="GPU", lora_name=None)


@pytest.fixture
def publisher():
    """vLLM's publisher as an engine replica configures it, and the replica's mirror."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    ipc_dir, pub_ep, replay_ep = private_ipc_endpoints()
    pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep, topic="kv")
    mirror = KVMirror(pub_ep, replay_ep, "127.0.0.1", ipc_dir)
    yield pub, mirror
    mirror.close()
    pub.shutdown()


def _handle(*mirrors: KVMirror) -> SimpleNamespace:
    """What a router calls on an engine replica (over Ray in a deployment): one mirror per
    DP rank of its engine."""
    async def snapshot(rank: int = 0):
        return mirrors[rank].snapshot()

    async def subscribe(key: str):
        for mirror in mirrors:
            mirror.admit(key.encode())

    return SimpleNamespace(kv_snapshot=SimpleNamespace(remote=snapshot),
                           kv_subscribe=SimpleNamespace(remote=subscribe))


def _send(pub, *events) -> None:
    from vllm.distributed.kv_events import KVEventBatch

    pub.publish(KVEventBatch(ts=time.time(), events=list(events)))


def _events_core(*replicas: str) -> tuple[RoutingCore, EventIndex]:
    """The router's own wiring: a routing core that follows events, these replicas joined."""
    core = RoutingCore(RouterConfig(index="events").routing_settings(), 16)
    for name in replicas:
        assert core.joined(name, 16, 100)
    index = core.index
    assert isinstance(index, EventIndex)
    return core, index


async def _until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def test_a_mirror_misses_nothing_the_engine_published_before_its_subscription_took_effect():
    """A simulated engine serves the moment it is built, and a ZMQ subscription takes effect
    some time after its connect (seconds on a busy host): batches published before it must
    still reach the mirror, from vLLM's replay buffer, whether a later batch shows the gap or
    none follows."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    ipc_dir, pub_ep, replay_ep = private_ipc_endpoints()
    pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep, topic="kv")
    mirror = None
    try:
        _send(pub, _stored([1, 2]))
        _send(pub, _stored([3]))
        deadline = time.monotonic() + 10
        # vLLM's publisher sends from a thread of its own; its replay buffer is the one sign
        # that both batches went out before the mirror exists.
        while len(pub._buffer) < 2:
            assert time.monotonic() < deadline, "vLLM's publisher never sent"
            time.sleep(0.01)
        mirror = KVMirror(pub_ep, replay_ep, "127.0.0.1", ipc_dir)
        while sorted(mirror.snapshot().keys) != [1, 2, 3]:
            assert time.monotonic() < deadline, f"mirror saw {mirror.snapshot()}"
            time.sleep(0.02)
        assert mirror.snapshot().seq == 1
        _send(pub, _stored([4]))
        while sorted(mirror.snapshot().keys) != [1, 2, 3, 4]:
            assert time.monotonic() < deadline, f"mirror saw {mirror.snapshot()}"
            time.sleep(0.02)
    finally:
        if mirror is not None:
            mirror.close()
        pub.shutdown()


def test_feed_follows_stores_removals_clears_and_resyncs_after_a_gap(publisher):
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved

    pub, mirror = publisher
    _send(pub, _stored([11, 12, 13]))
    deadline = time.time() + 10
    while len(mirror) < 3 and time.time() < deadline:
        time.sleep(0.02)
    assert mirror.snapshot().keys == [11, 12, 13]

    async def scenario() -> None:
        core, index = _events_core("e0")
        feeds = KVFeeds(core)
        feeds.join("e0", mirror.endpoint, mirror.server_key.decode(), _handle(mirror))
        feed = feeds.feeds["e0"]
        # A router that starts late learns what was stored before it from the snapshot.
        await _until(lambda: index.match([11, 12, 13]) == {"e0": 3})

        _send(pub, _stored([14]), BlockRemoved(block_hashes=[12], medium="GPU"))
        await _until(lambda: index.match([11, 12, 13, 14]) == {"e0": 1})
        assert index.size("e0") == 3

        _send(pub, AllBlocksCleared())
        await _until(lambda: index.size("e0") == 0)

        # Lose a batch: the publisher skips a sequence number. The feed notices the gap and
        # resynchronises from the mirror instead of trusting a view with a hole in it.
        _send(pub, _stored([21]))
        await _until(lambda: index.size("e0") == 1)
        resyncs = feed.resyncs
        next(pub._seq_gen)
        _send(pub, _stored([22]))
        await _until(lambda: feed.resyncs > resyncs)
        await _until(lambda: sorted(mirror.snapshot().keys) == [21, 22])
        await _until(lambda: index.match([21]) == {"e0": 1} and index.size("e0") == 2)
        feed.stop()

    asyncio.run(scenario())


def test_a_reset_reaches_every_router_before_the_engines_next_step(publisher):
    """vLLM says AllBlocksCleared only with the engine's next step: the mirror says it at
    once, so routers that did not ask for the reset stop predicting hits on emptied
    blocks before the next burst, not after its first request."""
    from vllm.distributed.kv_events import AllBlocksCleared

    pub, mirror = publisher
    _send(pub, _stored([31, 32]))
    deadline = time.time() + 10
    while len(mirror) < 2 and time.time() < deadline:
        time.sleep(0.02)

    async def scenario() -> None:
        routers = [_events_core("e0") for _ in range(2)]
        feeds = [KVFeeds(core) for core, _ in routers]
        for f in feeds:
            f.join("e0", mirror.endpoint, mirror.server_key.decode(), _handle(mirror))
        await _until(lambda: all(index.match([31, 32]) == {"e0": 2} for _, index in routers))
        mark = mirror.mark()  # what the replica does around vLLM's reset_prefix_cache
        mirror.reset(mark)
        await _until(lambda: all(index.size("e0") == 0 for _, index in routers), timeout=2.0)
        assert all(f.feeds["e0"].resyncs == 1 for f in feeds)  # told, not resynced
        _send(pub, _stored([33]))  # vLLM's numbering goes on: nothing to resync
        await _until(lambda: all(index.match([33]) == {"e0": 1} for _, index in routers))

        # Another router's request reached the engine between the reset and the mirror's
        # turn: vLLM's own clear came first, and what was stored after it is real.
        mark = mirror.mark()
        _send(pub, AllBlocksCleared(), _stored([34]))
        await _until(lambda: mirror.snapshot().keys == [34])
        mirror.reset(mark)
        assert mirror.snapshot().keys == [34]
        # A later batch reaches the routers after anything reset() said: they hold both.
        _send(pub, _stored([35]))
        await _until(lambda: all(index.match([35]) == {"e0": 1} for _, index in routers))
        assert all(index.match([34]) == {"e0": 1} for _, index in routers)

        # A clear older than what a router's view already reflects (one said before the
        # batch a newer snapshot includes) is not applied to it.
        with mirror._lock:
            mirror._publish((CLEARED_TOPIC.encode(), (0).to_bytes(8, "big"), b""))
        _send(pub, _stored([36]))
        await _until(lambda: all(index.match([36]) == {"e0": 1} for _, index in routers))
        assert all(index.match([34]) == {"e0": 1} for _, index in routers)
        for f in feeds:
            f.feeds["e0"].stop()

    asyncio.run(scenario())


def test_each_dp_rank_of_an_engine_is_followed_as_a_target_of_its_own():
    """An engine running two DP ranks: vLLM's publishers of rank 0 and 1 (each announcing its
    own rank in its batches) on the endpoints vLLM derives from the one configured, one
    mirror each in the replica, and a router whose targets are the two ranks."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    from rayattn.routing.targets import targets

    ipc_dir, pub_ep, replay_ep = private_ipc_endpoints()
    eps = [(dp_rank_endpoint(pub_ep, r), dp_rank_endpoint(replay_ep, r))
           for r in range(2)]
    assert eps[0] == (pub_ep, replay_ep) and len({e for pair in eps for e in pair}) == 4
    # Constructed as vLLM's scheduler of each rank constructs it: the configured endpoints
    # and the rank; the publisher offsets them itself.
    pubs = [ZmqEventPublisher(r, endpoint=pub_ep, replay_endpoint=replay_ep, topic="kv")
            for r in range(2)]
    mirrors = [KVMirror(*eps[r], "127.0.0.1", ipc_dir if r == 0 else None, rank=r)
               for r in range(2)]
    time.sleep(0.3)
    try:
        _send(pubs[0], _stored([1, 2, 3]))
        _send(pubs[1], _stored([7, 8]))
        names = targets("engine-a", 2)

        async def scenario() -> None:
            core, _ = _events_core(*names)
            feeds = KVFeeds(core)
            handle = _handle(*mirrors)
            for rank, name in enumerate(names):
                m = mirrors[rank]
                feeds.join(name, m.endpoint, m.server_key.decode(), handle, rank)
            index = core.index
            await _until(lambda: index.match([1, 2, 3]) == {names[0]: 3}
                         and index.match([7, 8]) == {names[1]: 2})
            # Live: a conversation's next blocks on rank 1 are rank 1's alone.
            _send(pubs[1], _stored([9]))
            await _until(lambda: index.match([7, 8, 9]) == {names[1]: 3})
            assert index.match([1, 2, 3, 9]) == {names[0]: 3}
            for name in names:
                feeds.leave(name)

        asyncio.run(scenario())
    finally:
        for m in reversed(mirrors):
            m.close()
        for p in pubs:
            p.shutdown()


def test_speculative_overlay_expires_and_yields_to_events():
    now = [0.0]
    index = EventIndex(ttl_s=5.0, clock=lambda: now[0])
    for r in ("a", "b"):
        index.add_replica(r)
    index.insert("a", [1, 2])  # the router sent a request carrying blocks 1, 2 to a
    assert index.match([1, 2, 3]) == {"a": 2} and index.speculative("a") == 2
    index.stored("a", [1])  # the engine confirmed block 1
    assert index.speculative("a") == 1 and index.match([1, 2]) == {"a": 2}
    index.removed("a", [2])  # ...and evicted block 2 before confirming it: gone for good
    assert index.match([1, 2]) == {"a": 1}
    index.insert("b", [7])
    now[0] = 6.0  # never confirmed: the guess expires
    assert index.match([7]) == {}
    assert index.match([1]) == {"a": 1}  # truth does not expire
    index.reset("a", [5])  # a snapshot replaces everything a held
    assert index.match([1]) == {} and index.match([5]) == {"a": 1}


def test_a_clear_keeps_the_requests_already_sent():
    now = [0.0]
    index = EventIndex(ttl_s=5.0, clock=lambda: now[0])
    index.add_replica("a")
    index.stored("a", [2])  # cached before a reset_prefix_cache
    index.insert("a", [1, 9])  # a request of the next burst, sent before the clear arrived
    index.cleared("a")  # vLLM's AllBlocksCleared, published with the engine's next step
    assert index.match([2]) == {}  # the old truth is gone...
    assert index.match([1, 9]) == {"a": 2}  # ...the sent request's prefix is still there
    now[0] = 6.0  # a kept guess still expires if no event confirms it
    assert index.match([1, 9]) == {}
    index.insert("a", [3])
    index.remove_replica("a")  # the replica left: nothing of it stays
    assert index.match([3]) == {}


def _offloaded(keys: list[int], medium: str = "CPU"):
    """What vLLM's offloading connector publishes for blocks it copied to host memory (its
    self-describing events: the real block hashes, the tier as `medium`)."""
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(block_hashes=keys, parent_block_hash=None,
                       token_ids=[0] * 4 * len(keys), block_size=4, lora_id=None,
                       medium=medium, lora_name=None)


def test_host_tier_events_reach_the_index_beside_the_gpu_cache(publisher):
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved

    pub, mirror = publisher
    # A conversation's history: blocks 1-4 computed on the GPU and offloaded; then blocks
    # 1-3 evicted from the GPU (the host copies stay). Block 2 is announced by two
    # overlapping chunks: it leaves the host tier with the second removal only. A storage
    # tier rayattn does not index is ignored.
    _send(pub, _stored([1, 2, 3, 4]), _offloaded([1, 2]), _offloaded([2, 3, 4]),
          BlockRemoved(block_hashes=[1, 2, 3], medium="GPU"), _offloaded([9], "STORAGE"))
    deadline = time.time() + 10
    while mirror.offloaded_blocks < 4 and time.time() < deadline:
        time.sleep(0.02)
    snap = mirror.snapshot()
    assert snap.keys == [4] and sorted(snap.offloaded) == [1, 2, 2, 3, 4]

    async def scenario() -> None:
        core, index = _events_core("e0", "e1")

        feeds = KVFeeds(core)
        feeds.join("e0", mirror.endpoint, mirror.server_key.decode(), _handle(mirror))
        # From the snapshot: nothing of 1-3 in e0's HBM, all of 1-4 in its host tier, so
        # vLLM would reload the whole prefix there (its connector looks past the GPU hit).
        await _until(lambda: index.match_tiers([1, 2, 3, 4, 5]) == ({"e0": 4}, {"e0": 4}))
        assert index.offloaded("e0") == 4 and index.size("e0") == 1

        _send(pub, BlockRemoved(block_hashes=[2], medium="CPU"))  # one of two chunks left
        _send(pub, _stored([1]))  # block 1 back in HBM (a request reloaded it)
        await _until(lambda: index.size("e0") == 2)
        assert index.match_tiers([1, 2, 3, 4]) == ({"e0": 4}, {"e0": 3})
        _send(pub, BlockRemoved(block_hashes=[2], medium="CPU"))
        await _until(lambda: index.offloaded("e0") == 3)
        # Block 2 is nowhere now: the match stops at it, whatever lies behind.
        assert index.match_tiers([1, 2, 3, 4]) == ({"e0": 1}, {})

        # A router's routing sees the split: e0 holds the prompt's first 3 blocks, 2 of them
        # only in host memory.
        route = core.request(list(range(64)))
        index.stored("e0", route.keys[:1])
        index.stored("e0", route.keys[1:3], "cpu")
        d = core.choose(route, ["e0", "e1"])
        assert (d.replica, d.predicted_cached_tokens, d.predicted_reload_tokens) == \
            ("e0", 48, 32)

        _send(pub, AllBlocksCleared())  # a reset empties both tiers (rayattn resets both)
        await _until(lambda: index.size("e0") == 0 and index.offloaded("e0") == 0)
        feeds.feeds["e0"].stop()

    asyncio.run(scenario())
    assert mirror.snapshot().offloaded == []


def test_host_tier_is_looked_up_only_past_the_gpu_hit():
    index = EventIndex()
    for r in ("a", "b"):
        index.add_replica(r)
    index.stored("a", [1, 2])
    index.stored("a", [3, 4, 6], "cpu")
    index.stored("b", [2, 3], "cpu")  # b's host tier lacks the head: no hit at all
    assert index.match_tiers([1, 2, 3, 4, 5, 6]) == ({"a": 4}, {"a": 2})
    index.insert("b", [1])  # sent there: counts as b's own cache at once
    assert index.match_tiers([1, 2, 3, 4]) == ({"a": 4, "b": 3}, {"a": 2, "b": 2})
    index.reset("a", [1], offloaded=[2])  # a snapshot replaces both tiers
    assert index.match_tiers([1, 2, 3])[0]["a"] == 2
    index.remove_replica("a")
    assert index.offloaded("a") == 0 and "a" not in index.match_tiers([1, 2])[0]


def test_only_admitted_routers_read_the_events(publisher):
    """Issue 25, item 1: before, vLLM's publisher and replay sockets bound tcp://* with no
    authentication, and anyone reaching the node read every tenant's token ids. Now vLLM's
    sockets are IPC files in a 0700 directory, and the relay answers only CurveZMQ clients
    whose key the engine admitted: a plain subscriber and one with a key of its own (even
    knowing the relay's public key) read nothing while an admitted one reads every batch."""
    import os
    import stat

    import zmq

    from rayattn.engine.kv_mirror import CurveKeys, subscriber

    pub, mirror = publisher
    ipc_dir = mirror.vllm_pub.removeprefix("ipc://").rsplit("/", 1)[0]
    assert stat.S_IMODE(os.stat(ipc_dir).st_mode) == 0o700
    assert mirror.vllm_pub.startswith("ipc://") and mirror.vllm_replay.startswith("ipc://")
    assert mirror.endpoint.startswith("tcp://127.0.0.1:")  # the node address, not *

    ctx = zmq.Context()
    plain = subscriber(ctx, mirror.endpoint)
    stranger = subscriber(ctx, mirror.endpoint, mirror.server_key, CurveKeys.new())
    router_keys = CurveKeys.new()
    mirror.admit(router_keys.public)
    router = subscriber(ctx, mirror.endpoint, mirror.server_key, router_keys)
    time.sleep(0.5)  # handshakes (and refusals)
    for i in range(20):
        _send(pub, _stored([100 + i]))
    got = {"plain": 0, "stranger": 0, "router": 0}
    deadline = time.time() + 5
    while time.time() < deadline and got["router"] < 20:
        for name, sock in (("plain", plain), ("stranger", stranger), ("router", router)):
            while sock.poll(10):
                parts = sock.recv_multipart()
                assert len(parts) == 3
                got[name] += 1
    assert got == {"plain": 0, "stranger": 0, "router": 20}
    for sock in (plain, stranger, router):
        sock.close()
    ctx.term()


def test_a_feed_silent_while_events_are_due_is_resynced(publisher):
    """Issue 25, item 9: a feed that stops delivering (a broken connection, a publisher
    gone) left the router's view stale with no signal. Now a request that filled new
    blocks makes events due; a feed silent past the limit counts as stale and resyncs."""
    pub, mirror = publisher

    async def scenario() -> None:
        core, _ = _events_core("e0")
        feeds = KVFeeds(core)
        feeds.join("e0", mirror.endpoint, mirror.server_key.decode(), _handle(mirror))
        feed = feeds.feeds["e0"]
        await _until(lambda: feed.resyncs == 1)
        _send(pub, _stored([1]))
        await _until(lambda: feed.batches == 1)
        # Sent before the last batch arrived: its blocks' events came, nothing is due.
        feeds.expect("e0", since=feed.heard_at - 1)
        assert feed.expected_since is None
        assert feeds.restart_stale(stale_s=0.0) == []
        # Sent after it, and no event since: due; silent past the limit, resynced.
        feeds.expect("e0", since=time.monotonic())
        assert feeds.restart_stale(stale_s=60) == []
        await asyncio.sleep(0.05)
        assert feeds.restart_stale(stale_s=0.01) == ["e0"]
        await _until(lambda: feed.resyncs == 2)
        assert feeds.stats("e0")["stale"] == 1 and feed.expected_since is None
        # An event arriving in time clears what was due.
        feeds.expect("e0", since=time.monotonic())
        _send(pub, _stored([2]))
        await _until(lambda: feed.expected_since is None)
        feed.stop()

    asyncio.run(scenario())


def test_a_new_feed_holds_readiness_until_its_snapshot_and_misses_nothing_after_it(publisher):
    """A router that routes before its view of an engine is taken places a conversation's
    next turn cold (seen: a second router predicted 0 of 224 cached tokens on 4 of 18 later
    turns). The feed reports itself syncing until its first snapshot is applied, and the
    subscription is connected before the snapshot is taken: a batch published while the
    snapshot is being answered reaches the view without waiting for a later gap."""
    pub, mirror = publisher
    _send(pub, _stored([31, 32]))

    async def scenario() -> None:
        core, index = _events_core("e0")
        handle = _handle(mirror)

        async def snapshot_while_publishing(rank: int = 0):
            await _until(lambda: len(mirror) >= 2)
            snap = mirror.snapshot()
            _send(pub, _stored([33]))  # after the snapshot's sequence number
            return snap

        handle.kv_snapshot.remote = snapshot_while_publishing
        feeds = KVFeeds(core)
        feeds.join("e0", mirror.endpoint, mirror.server_key.decode(), handle)
        feed = feeds.feeds["e0"]
        assert feeds.syncing() == ["e0"] and feeds.stats("e0")["synced"] is False
        await _until(lambda: feed.resyncs == 1)
        assert feeds.syncing() == [] and feeds.stats("e0")["synced"] is True
        await _until(lambda: index.size("e0") == 3)
        assert index.match([31, 32, 33]) == {"e0": 3}
        assert feed.resyncs == 1 and feed.batches == 1  # no gap, no second snapshot
        feed.stop()

        # A feed whose engine never answers holds the router's start back only for the
        # grace period, and no feed holds back a router that has started.
        async def never(rank: int = 0):
            await asyncio.sleep(3600)

        handle.kv_snapshot.remote = never
        assert core.joined("e1", 16, 100)
        feeds.join("e1", mirror.endpoint, mirror.server_key.decode(), handle)
        await asyncio.sleep(0.2)
        feeds.hold()
        assert feeds.syncing() == ["e1"]
        grace, feeds.hold_until = feeds.hold_until, time.monotonic()  # the grace is over
        assert feeds.syncing() == []
        feeds.hold_until = grace
        assert feeds.syncing() == ["e1"]
        feeds.release()
        assert feeds.syncing() == []
        feeds.feeds["e1"].stop()

    asyncio.run(scenario())


def test_a_feed_whose_handshake_is_refused_does_not_count_as_synced(publisher):
    """A router whose key the engine never admitted is refused at the CurveZMQ handshake:
    its feed must not take a snapshot it could never follow (and report itself synced, its
    view frozen); it admits itself again and retries."""
    pub, mirror = publisher

    async def scenario() -> None:
        core, _ = _events_core("e0")
        handle = _handle(mirror)
        admissions = 0

        async def refused(key: str) -> None:  # the engine forgets to admit this router
            nonlocal admissions
            admissions += 1

        handle.kv_subscribe.remote = refused
        feeds = KVFeeds(core)
        feeds.join("e0", mirror.endpoint, mirror.server_key.decode(), handle)
        feed = feeds.feeds["e0"]
        await _until(lambda: admissions >= 2)  # refused, admitted again, retried
        assert feed.synced_at is None and feed.resyncs == 0
        assert feeds.syncing() == ["e0"]
        feed.stop()

    asyncio.run(scenario())
