"""A model's engine replicas as its routing core sees them: each replica Serve runs joins
the core under its targets (the replica as a whole, or each DP rank of its engine), with its
capacity, devices and batch size, its KV events followed; it leaves when Serve drops it or it
stops answering (server/fleet/replica_set.py decides which)."""

from __future__ import annotations

from collections.abc import Callable

from rayattn.engine.protocol import EngineInfo
from rayattn.metrics.router_metrics import RouterMetrics
from rayattn.routing.core import RoutingCore
from rayattn.routing.targets import replica_of, targets
from rayattn.server.fleet.adapters import AdapterRegistry
from rayattn.server.fleet.kv_feeds import KVFeeds
from rayattn.server.fleet.replica_set import Replica, ReplicaSet
from rayattn.server.fleet.warming import Warming


class FleetView:
    def __init__(self, core: RoutingCore, engines: object, adapters: AdapterRegistry,
                 metrics: RouterMetrics | None, on_join: Callable[[], None],
                 on_leave: Callable[[str], None]) -> None:
        """`engines`: the engine deployment's handle; `on_join`: room on a new replica (a
        waiting request may go); `on_leave(replica)`: forget what was learnt of it."""
        self.core = core
        self.feeds = KVFeeds(core)
        self.adapters = adapters
        self._metrics = metrics
        self._on_join, self._on_leave = on_join, on_leave
        self.replicas = ReplicaSet(engines, self._joined, self._left, on_info=self._probed)
        self.warming: Warming | None = None
        """Warms joining replicas and moves leaving ones' conversations (the dispatcher's)."""

    @property
    def members(self) -> dict[str, Replica]:
        return self.replicas.members

    def live(self) -> list[str]:
        """The engine replicas that are up (Serve's names)."""
        return self.replicas.live()

    def targets(self, r: Replica) -> list[str]:
        """What the core routes to on replica `r`: each of its engine's DP ranks, or the
        replica as a whole (routing/targets.py)."""
        ranks = r.info.dp_ranks if r.info is not None else 1
        return targets(r.name, ranks if self.core.settings.dp_rank_routing else 1)

    def up_targets(self) -> list[str]:
        """The targets of the replicas up."""
        return [t for n in self.live() for t in self.targets(self.members[n])]

    def live_targets(self) -> list[str]:
        """The targets routed to: those of the replicas up, but for any held while it is
        warmed (server/fleet/warming.py)."""
        up = self.up_targets()
        return self.warming.routable(up) if self.warming is not None else up

    def info(self, replica: str) -> EngineInfo | None:
        r = self.members.get(replica)
        return r.info if r is not None else None

    def serving(self, adapter: str, among: list[str] | None = None) -> list[str]:
        """The live replicas or targets (of `among`) whose engines answer to `adapter`."""
        return [n for n in (self.live() if among is None else among)
                if self.adapters.serves(self.members[replica_of(n)], adapter)]

    async def start(self) -> None:
        await self.replicas.start()

    def _joined(self, r: Replica) -> bool:
        info = r.info
        assert info is not None
        names = self.targets(r)
        for i, name in enumerate(names):
            # Engines naming the same GPUs share them (two engines on one GPU).
            device = ",".join(sorted(d for d in devices(info, len(names), i) if d)) or None
            if not self.core.joined(name, info.block_size, capacity(info, len(names), i),
                                    device, batch(info, len(names)), info.host_kv_gib > 0):
                for joined in names[:i]:
                    self.core.left(joined)
                return False
        self._follow(r)
        if self.warming is not None and not r.up:  # up already: the same replica retargeted
            self.warming.joined(r, names)
        self._on_join()
        return True

    def _follow(self, r: Replica) -> None:
        """Subscribe to the KV events of each of `r`'s targets: a rank's own stream, or the
        engine's one stream where it runs one rank. A replica routed to as a whole whose
        engine runs several ranks has no one stream: the router's view of it is what it
        sent there, for router.speculative_ttl_s (router.dp_rank_routing off)."""
        assert r.info is not None
        names = self.targets(r)
        if len(names) != r.info.dp_ranks:
            return
        for rank, (name, info) in enumerate(zip(names, r.info.ranks, strict=True)):
            self.feeds.join(name, info.kv_events, info.kv_events_key, r.handle, rank)

    def _left(self, r: Replica) -> None:
        self._on_leave(r.name)
        # Moved only off a replica that left the deployment (scale-down, an update): one
        # that died may have died of its last request (a query of death), not to be sent
        # elsewhere. Up still: the same replica retargeted.
        if self.warming is not None and not r.up and r.name not in self.members:
            self.warming.leaving(r, self.targets(r))
        for name in self.targets(r):
            if self._metrics is not None:
                self._metrics.left(name)
            self.feeds.leave(name)
            self.core.left(name)

    def _probed(self, r: Replica) -> None:
        assert r.info is not None
        names = self.targets(r)
        if len(names) == 1:
            self.core.reported(r.name, r.info.inflight_by_origin, r.info.inflight_stamp)
        else:
            for name, rank in zip(names, r.info.ranks, strict=True):
                self.core.reported(name, rank.inflight_by_origin, r.info.inflight_stamp)
        # An adapter's blocks are hashed with the path the engine loaded it from.
        self.adapters.probed(r)

    def refeed(self) -> None:
        """Every live replica's KV feed afresh (a new index, or a cold start): each resyncs
        from its engine's snapshot."""
        for name in list(self.feeds.feeds):
            self.feeds.leave(name)
        for name in self.live():
            r = self.members[name]
            if r.info is not None:
                self._follow(r)

    def retarget(self, reconfigure: Callable[[], object]) -> None:
        """Other targets on the same replicas (router.dp_rank_routing switched): every
        replica leaves under the old names and joins under the new ones, with views rebuilt
        from their engines' events; `reconfigure` switches the core in between."""
        up = [self.members[n] for n in self.live()]
        for r in up:
            self._left(r)
        reconfigure()
        for r in up:
            r.up = self._joined(r)


def capacity(info: EngineInfo, targets: int, i: int) -> int:
    """KV blocks of target `i` of an engine routed to as `targets` targets: a rank's own
    where each rank is one, else the engine's (vLLM's sum over its ranks)."""
    return info.ranks[i].num_gpu_blocks if targets > 1 else info.num_gpu_blocks


def batch(info: EngineInfo, targets: int) -> int:
    """Requests one target runs in a batch: vLLM's max_num_seqs is per DP rank, so a target
    of several ranks (the engine routed as one) batches theirs."""
    return info.max_num_seqs * max(1, len(info.ranks) // targets)


def devices(info: EngineInfo, targets: int, i: int) -> list[str | None]:
    """The GPUs target `i` computes on: DP ranks of one device each have their own."""
    per, rest = divmod(len(info.devices), targets)
    return info.devices[i * per:(i + 1) * per] if per and not rest else info.devices
