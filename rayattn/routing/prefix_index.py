"""The router's two pictures of what each replica's prefix cache holds, over one shared part
(routing/block_owners.py: block key <-> replicas, longest-prefix match):

- `PrefixIndex` (`router.index: predicted`): the router's own guess from where it sent
  requests, bounded per replica by an LRU of that replica's real KV capacity.
- `EventIndex` (`router.index: events`): the engines' real caches from their KV events, with
  the router's recent decisions as a short-lived speculative overlay; the engines evict, so
  nothing here does.

Both satisfy `CacheIndex`, which is all the routing core and the policies use.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from rayattn.routing.block_owners import BlockOwners
from rayattn.routing.host_tier import HostTier
from rayattn.routing.speculative_overlay import SpeculativeOverlay


class CacheIndex(Protocol):
    """What the routing core and the policies ask of a cache index (either kind)."""

    def add_replica(self, replica: str, capacity_blocks: int) -> None: ...

    def remove_replica(self, replica: str) -> None: ...

    @property
    def replicas(self) -> list[str]: ...

    def size(self, replica: str) -> int:
        """Blocks counted as held by `replica` (its speculative overlay aside)."""
        ...

    def speculative(self, replica: str) -> int | None:
        """Blocks counted on `replica` on the router's word alone (None: no such overlay)."""
        ...

    def offloaded(self, replica: str) -> int:
        """Blocks `replica` holds in its host-memory tier (0 where the index can't know)."""
        ...

    def match(self, keys: Sequence[int]) -> dict[str, int]:
        """Number of leading blocks of `keys` each replica holds (replicas with 0 omitted)."""
        ...

    def match_tiers(self, keys: Sequence[int]) -> tuple[dict[str, int], dict[str, int]]:
        """`match`, and how many of each replica's matched blocks it would reload from its
        host tier rather than find in its own cache."""
        ...

    def insert(self, replica: str, keys: Sequence[int]) -> None:
        """The router sent (or finished) a request carrying `keys` on `replica`."""
        ...


class PrefixIndex:
    """The router's own guess: blocks count as cached where the router sent them, in a
    per-replica LRU bounded by that replica's real KV capacity.

    Capacity mirrors the engine (num_gpu_blocks it reported), so the index forgets blocks
    about when the engine evicts them instead of believing in a cache it no longer has.
    Chains are touched tail-first so the head of a prefix is the most recently used, as vLLM
    frees a finished request's blocks tail-first (tails are evicted first)."""

    def __init__(self, on_evict: Callable[[str, int], None] | None = None,
                 on_store: Callable[[str, Sequence[int]], None] | None = None) -> None:
        self._on_evict = on_evict
        """Called with (replica, key) for every block the LRU bound evicts (the simulator
        turns these into BlockRemoved events)."""
        self._on_store = on_store
        """Called with (replica, keys) after `insert` (the simulator's BlockStored events)."""
        # Each replica's keys in recency order, least recent first: the LRU order itself.
        self._blocks: BlockOwners[OrderedDict[int, None]] = BlockOwners(OrderedDict)
        self._capacity: dict[str, int] = {}

    # --- membership ----------------------------------------------------------------
    def add_replica(self, replica: str, capacity_blocks: int) -> None:
        """A new replica starts empty (its engine's cache is empty too)."""
        self._blocks.add_replica(replica)
        self._capacity[replica] = max(1, capacity_blocks)
        self._evict(replica)

    def remove_replica(self, replica: str) -> None:
        """Forget everything a dead or removed replica held."""
        self._blocks.remove_replica(replica)
        self._capacity.pop(replica, None)

    @property
    def replicas(self) -> list[str]:
        return self._blocks.replicas

    def size(self, replica: str) -> int:
        return self._blocks.size(replica)

    def capacity(self, replica: str) -> int:
        return self._capacity.get(replica, 0)

    def speculative(self, replica: str) -> int | None:
        return None

    def offloaded(self, replica: str) -> int:
        return 0

    # --- queries -------------------------------------------------------------------
    def match(self, keys: Sequence[int]) -> dict[str, int]:
        return self._blocks.match(keys)

    def match_tiers(self, keys: Sequence[int]) -> tuple[dict[str, int], dict[str, int]]:
        return self.match(keys), {}

    # --- updates -------------------------------------------------------------------
    def insert(self, replica: str, keys: Sequence[int]) -> None:
        lru = self._blocks.held(replica)
        if lru is None:
            return  # replica removed while the request was in flight
        for key in reversed(keys):
            if not self._blocks.add(replica, key):
                lru.move_to_end(key)
        self._evict(replica)
        if self._on_store is not None:
            self._on_store(replica, keys)

    def remove_blocks(self, replica: str, keys: Sequence[int]) -> None:
        """Precise mode: the engine reported these blocks evicted."""
        for key in keys:
            self._blocks.discard(replica, key)

    def _evict(self, replica: str) -> None:
        lru, cap = self._blocks.held(replica), self._capacity[replica]
        while lru is not None and len(lru) > cap:
            key = next(iter(lru))
            self._blocks.discard(replica, key)
            if self._on_evict is not None:
                self._on_evict(replica, key)


class EventIndex:
    """The engines' real caches, from their KV events, plus a speculative overlay.

    Truth changes only through `stored` / `removed` / `cleared` / `reset` (the event feed);
    the engine evicts, so there is no capacity bound here. `insert` (the router's own
    routing decisions) goes to the overlay: a block counts as cached on a replica from the
    moment a request carrying it is sent there, until the engine's event confirms or
    removes it, or `ttl_s` passes."""

    def __init__(self, ttl_s: float = 30.0, clock: Callable[[], float] | None = None) -> None:
        # No order is kept per replica: the engine, not this index, decides what goes.
        self._blocks: BlockOwners[dict[int, None]] = BlockOwners(dict)
        self._host = HostTier()
        self.overlay = SpeculativeOverlay(ttl_s, clock)

    # --- membership ----------------------------------------------------------------
    def add_replica(self, replica: str, capacity_blocks: int = 0) -> None:
        """A new replica starts empty (its events fill it). `capacity_blocks` is not used:
        the engine evicts, and says so."""
        self._blocks.add_replica(replica)
        self._host.add_replica(replica)

    def remove_replica(self, replica: str) -> None:
        self._blocks.remove_replica(replica)
        self._host.remove_replica(replica)
        self.overlay.forget(replica)

    @property
    def replicas(self) -> list[str]:
        return self._blocks.replicas

    def size(self, replica: str) -> int:
        return self._blocks.size(replica)

    def speculative(self, replica: str) -> int | None:
        return self.overlay.count(replica)

    def offloaded(self, replica: str) -> int:
        return self._host.size(replica)

    # --- queries -------------------------------------------------------------------
    def match(self, keys: Sequence[int]) -> dict[str, int]:
        return self.match_tiers(keys)[0]

    def match_tiers(self, keys: Sequence[int]) -> tuple[dict[str, int], dict[str, int]]:
        """What vLLM's scheduler will find: the leading blocks in the engine's own cache,
        then, from the first one missing there, the run its offloading connector holds."""
        held = self._blocks.match(keys, self._owners_of)
        return held, self._host.extend(keys, held)

    def _owners_of(self, key: int) -> set[str] | None:
        return self.overlay.owners(key, self._blocks.owners(key))

    # --- the router's own decisions: the overlay --------------------------------------
    def insert(self, replica: str, keys: Sequence[int]) -> None:
        if replica in self._blocks:
            self.overlay.insert(replica, keys, self._blocks.owners)

    # --- from the engine's events ----------------------------------------------------
    def stored(self, replica: str, keys: Sequence[int], tier: str = "gpu") -> None:
        if replica not in self._blocks:
            return
        if tier != "gpu":
            self._host.stored(replica, keys)
            return
        for key in keys:
            self._blocks.add(replica, key)
            self.overlay.drop(key, replica)

    def removed(self, replica: str, keys: Sequence[int], tier: str = "gpu") -> None:
        if tier != "gpu":
            self._host.removed(replica, keys)
            return
        for key in keys:
            self._blocks.discard(replica, key)
            self.overlay.drop(key, replica)

    def cleared(self, replica: str) -> None:
        self.reset(replica, [])

    def reset(self, replica: str, keys: Sequence[int], offloaded: Sequence[int] = ()) -> None:
        """Replace what `replica` holds with `keys` and its host tier with `offloaded` (a
        snapshot from its engine; both empty: the engine was reset). The
        speculative overlay stays: it stands for requests already sent there whose blocks
        the engine has not stored yet, which a clear or a snapshot cannot know about.
        (vLLM publishes a reset_prefix_cache's AllBlocksCleared with the engine's next
        step, so it lands after the first requests of the next burst were routed; dropping
        their overlay sent their siblings elsewhere to prefill the same prefix again.)"""
        if replica not in self._blocks:
            return  # it left (a feed's last snapshot can land after that)
        self._blocks.remove_replica(replica)
        self._host.remove_replica(replica)
        self.add_replica(replica)
        self.stored(replica, keys)
        self.stored(replica, offloaded, "cpu")
