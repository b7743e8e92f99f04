"""Which replica holds which prefix blocks: an inverted index (block key -> replicas) plus a
per-replica LRU bounded by that replica's real KV capacity.

Capacity mirrors the engine (num_gpu_blocks it reported), so the index forgets blocks about
when the engine evicts them instead of believing in a cache it no longer has. Chains are
touched tail-first so the head of a prefix is the most recently used, as vLLM frees a
finished request's blocks tail-first (tails are evicted first).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence


class PrefixIndex:
    def __init__(self, on_evict: Callable[[str, int], None] | None = None,
                 on_store: Callable[[str, Sequence[int]], None] | None = None) -> None:
        self._on_evict = on_evict
        """Called with (replica, key) for every block the LRU bound evicts (the simulator
        turns these into BlockRemoved events)."""
        self._on_store = on_store
        """Called with (replica, keys) after `insert` (the simulator's BlockStored events)."""
        self._owners: dict[int, set[str]] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}

    # --- membership ----------------------------------------------------------------
    def add_replica(self, replica: str, capacity_blocks: int) -> None:
        """A new replica starts empty (its engine's cache is empty too)."""
        self._lru.setdefault(replica, OrderedDict())
        self._capacity[replica] = max(1, capacity_blocks)
        self._evict(replica)

    def remove_replica(self, replica: str) -> None:
        """Forget everything a dead or removed replica held."""
        for key in self._lru.pop(replica, {}):
            owners = self._owners.get(key)
            if owners is not None:
                owners.discard(replica)
                if not owners:
                    del self._owners[key]
        self._capacity.pop(replica, None)

    @property
    def replicas(self) -> list[str]:
        return list(self._lru)

    def size(self, replica: str) -> int:
        return len(self._lru.get(replica, ()))

    def capacity(self, replica: str) -> int:
        return self._capacity.get(replica, 0)

    def speculative(self, replica: str) -> int | None:
        """Blocks counted on `replica` on the router's word alone (None: no such overlay)."""
        return None

    def offloaded(self, replica: str) -> int:
        """Blocks `replica` holds in its host-memory tier (events only)."""
        return 0

    def match_tiers(self, keys: Sequence[int]) -> tuple[dict[str, int], dict[str, int]]:
        """`match`, and how many of each replica's matched blocks it would reload from its
        host tier rather than find in its own cache."""
        return self.match(keys), {}

    # --- queries -------------------------------------------------------------------
    def match(self, keys: Sequence[int]) -> dict[str, int]:
        """Number of leading blocks of `keys` each replica holds (replicas with 0 omitted).

        Walks the chain once, intersecting owner sets, so the cost is O(blocks matched)
        rather than O(replicas × blocks)."""
        result: dict[str, int] = {}
        if not keys:
            return result
        alive = self._owners_of(keys[0])
        if not alive:
            return result
        alive = set(alive)
        for i in range(1, len(keys)):
            owners = self._owners_of(keys[i])
            nxt = alive & owners if owners else set()
            for r in alive - nxt:
                result[r] = i
            alive = nxt
            if not alive:
                break
        for r in alive:
            result[r] = len(keys)
        return result

    def _owners_of(self, key: int) -> set[str] | None:
        return self._owners.get(key)

    # --- updates -------------------------------------------------------------------
    def insert(self, replica: str, keys: Sequence[int]) -> None:
        lru = self._lru.get(replica)
        if lru is None:
            return  # replica removed while the request was in flight
        for key in reversed(keys):
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                self._owners.setdefault(key, set()).add(replica)
        self._evict(replica)
        if self._on_store is not None:
            self._on_store(replica, keys)

    def remove_blocks(self, replica: str, keys: Sequence[int]) -> None:
        """Precise mode: the engine reported these blocks evicted."""
        lru = self._lru.get(replica)
        if lru is None:
            return
        for key in keys:
            if key in lru:
                del lru[key]
                self._drop_owner(key, replica)

    def _evict(self, replica: str) -> None:
        lru, cap = self._lru[replica], self._capacity[replica]
        while len(lru) > cap:
            key, _ = lru.popitem(last=False)
            self._drop_owner(key, replica)
            if self._on_evict is not None:
                self._on_evict(replica, key)

    def _drop_owner(self, key: int, replica: str) -> None:
        owners = self._owners.get(key)
        if owners is not None:
            owners.discard(replica)
            if not owners:
                del self._owners[key]


class EventIndex(PrefixIndex):
    """The engines' real caches, from their KV events, plus a speculative overlay.

    Truth changes only through `stored` / `removed` / `cleared` / `reset` (the event feed);
    the engine evicts, so there is no capacity bound here. `insert` (the router's own
    routing decisions) goes to the overlay: a block counts as cached on a replica from the
    moment a request carrying it is sent there, until the engine's event confirms or
    removes it, or `ttl_s` passes."""

    def __init__(self, ttl_s: float = 30.0, clock: Callable[[], float] | None = None) -> None:
        import time

        super().__init__()
        self._host: dict[str, Counter[int]] = {}
        """Per replica, the blocks of its host tier (vLLM's offloading connector), counted:
        a block announced by several offloaded chunks leaves with the last of them."""
        self.ttl_s = ttl_s
        self._clock = clock or time.monotonic
        self._spec: dict[int, dict[str, float]] = {}
        # (expiry, key, replica) in insertion order, which is expiry order (one ttl, a
        # monotonic clock): swept on every insert, so unconfirmed blocks (unique prompts,
        # blocks evicted before their event) do not pile up.
        self._expiry: deque[tuple[float, int, str]] = deque()

    def add_replica(self, replica: str, capacity_blocks: int = 0) -> None:
        self._lru.setdefault(replica, OrderedDict())
        self._capacity[replica] = 1 << 62
        self._host.setdefault(replica, Counter())

    def remove_replica(self, replica: str) -> None:
        super().remove_replica(replica)
        self._host.pop(replica, None)
        for key in [k for k, owners in self._spec.items() if replica in owners]:
            self._drop_spec(key, replica)

    def offloaded(self, replica: str) -> int:
        return len(self._host.get(replica, ()))

    def match(self, keys: Sequence[int]) -> dict[str, int]:
        return self.match_tiers(keys)[0]

    def match_tiers(self, keys: Sequence[int]) -> tuple[dict[str, int], dict[str, int]]:
        """What vLLM's scheduler will find: the leading blocks in the engine's own cache,
        then, from the first one missing there, the run its offloading connector holds
        (it looks up the host tier only past the GPU hit, and reloads those blocks)."""
        held = PrefixIndex.match(self, keys)
        reloaded: dict[str, int] = {}
        for replica, host in self._host.items():
            if not host:
                continue
            start = end = held.get(replica, 0)
            while end < len(keys) and keys[end] in host:
                end += 1
            if end > start:
                held[replica], reloaded[replica] = end, end - start
        return held, reloaded

    def _owners_of(self, key: int) -> set[str] | None:
        spec = self._spec.get(key)
        truth = self._owners.get(key)
        if not spec:
            return truth
        now = self._clock()
        live = {r for r, exp in spec.items() if exp > now}
        if len(live) < len(spec):
            for r in [r for r, exp in spec.items() if exp <= now]:
                self._drop_spec(key, r)
        return (truth | live) if truth else live

    def insert(self, replica: str, keys: Sequence[int]) -> None:
        if replica not in self._lru:
            return
        now = self._clock()
        self._sweep(now)
        exp = now + self.ttl_s
        for key in keys:
            owners = self._owners.get(key)
            if owners is None or replica not in owners:
                self._spec.setdefault(key, {})[replica] = exp
                self._expiry.append((exp, key, replica))

    def _sweep(self, now: float) -> None:
        q = self._expiry
        while q and q[0][0] <= now:
            exp, key, replica = q.popleft()
            spec = self._spec.get(key)
            if spec is not None and spec.get(replica) == exp:  # not renewed since
                self._drop_spec(key, replica)

    def speculative(self, replica: str) -> int | None:
        return sum(1 for owners in self._spec.values() if replica in owners)

    # --- from the engine's events ----------------------------------------------------
    def stored(self, replica: str, keys: Sequence[int], tier: str = "gpu") -> None:
        lru = self._lru.get(replica)
        if lru is None:
            return
        if tier != "gpu":
            self._host[replica].update(keys)
            return
        for key in keys:
            lru[key] = None
            self._owners.setdefault(key, set()).add(replica)
            self._drop_spec(key, replica)

    def removed(self, replica: str, keys: Sequence[int], tier: str = "gpu") -> None:
        if tier != "gpu":
            host = self._host.get(replica)
            for key in keys if host is not None else ():
                if host[key] <= 1:
                    host.pop(key, None)
                else:
                    host[key] -= 1
            return
        self.remove_blocks(replica, keys)
        for key in keys:
            self._drop_spec(key, replica)

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
        if replica not in self._lru:
            return  # it left (a feed's last snapshot can land after that)
        PrefixIndex.remove_replica(self, replica)
        self._host.pop(replica, None)
        self.add_replica(replica)
        self.stored(replica, keys)
        self.stored(replica, offloaded, "cpu")

    def _drop_spec(self, key: int, replica: str) -> None:
        owners = self._spec.get(key)
        if owners is not None:
            owners.pop(replica, None)
            if not owners:
                del self._spec[key]
