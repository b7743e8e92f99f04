"""Which replica holds which block, both ways round: block key -> replicas (to match a
prompt's prefix) and replica -> block keys (to forget a replica), kept consistent with each
other. The part both cache indexes share (rayattn/routing/prefix_index.py): `PrefixIndex`
bounds each replica's blocks with an LRU on top of it, `EventIndex` mirrors the engines' own
caches into it and overlays the router's speculation at match time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

Holding = TypeVar("Holding", bound=dict[int, None])
"""Per replica, the keys of the blocks it holds, as a dict used as an ordered set: the index
on top picks the kind (an OrderedDict where it keeps a recency order, a plain dict where no
order matters)."""

OwnersOf = Callable[[int], set[str] | None]


class BlockOwners(Generic[Holding]):
    def __init__(self, holding: Callable[[], Holding]) -> None:
        self._new_holding = holding
        self._owners: dict[int, set[str]] = {}
        """Block key -> the replicas holding it (no empty sets: a key nobody holds leaves)."""
        self._held: dict[str, Holding] = {}

    # --- membership ----------------------------------------------------------------
    def add_replica(self, replica: str) -> None:
        """Start following `replica` (with no blocks); one already followed keeps its own."""
        if replica not in self._held:
            self._held[replica] = self._new_holding()

    def remove_replica(self, replica: str) -> None:
        """Forget `replica` and every block it held."""
        for key in self._held.pop(replica, ()):
            self._drop_owner(key, replica)

    def __contains__(self, replica: object) -> bool:
        return replica in self._held

    @property
    def replicas(self) -> list[str]:
        return list(self._held)

    def held(self, replica: str) -> Holding | None:
        """`replica`'s block keys (None: not followed). Reordering them is the caller's
        business; adding or removing keys goes through `add` / `discard` only, so that the
        owners stay consistent."""
        return self._held.get(replica)

    def size(self, replica: str) -> int:
        return len(self._held.get(replica, ()))

    # --- blocks --------------------------------------------------------------------
    def add(self, replica: str, key: int) -> bool:
        """`replica` holds block `key`; False when it already did (or is not followed)."""
        held = self._held.get(replica)
        if held is None or key in held:
            return False
        held[key] = None
        self._owners.setdefault(key, set()).add(replica)
        return True

    def discard(self, replica: str, key: int) -> bool:
        """`replica` no longer holds block `key`; False when it did not."""
        held = self._held.get(replica)
        if held is None or key not in held:
            return False
        del held[key]
        self._drop_owner(key, replica)
        return True

    def owners(self, key: int) -> set[str] | None:
        """The replicas holding `key` (None: none). The set is the index's own: read it,
        don't keep or change it."""
        return self._owners.get(key)

    def items(self) -> Iterator[tuple[int, set[str]]]:
        """Every held block with its owners."""
        return iter(self._owners.items())

    # --- queries -------------------------------------------------------------------
    def match(self, keys: Sequence[int], owners_of: OwnersOf | None = None) -> dict[str, int]:
        """Number of leading blocks of `keys` each replica holds (replicas with 0 omitted).
        `owners_of`: who holds a key, when the caller sees more than these owners (the
        events index adds its speculative overlay); by default `owners`.

        Walks the chain once, intersecting owner sets, so the cost is O(blocks matched)
        rather than O(replicas × blocks)."""
        result: dict[str, int] = {}
        if not keys:
            return result
        lookup = owners_of or self._owners.get
        first = lookup(keys[0])
        if not first:
            return result
        alive = set(first)
        for i in range(1, len(keys)):
            owners = lookup(keys[i])
            nxt = alive & owners if owners else set()
            for r in alive - nxt:
                result[r] = i
            alive = nxt
            if not alive:
                break
        for r in alive:
            result[r] = len(keys)
        # In the replicas' name order, not the owner sets' (Python's string hashing, seeded
        # per process): a policy that takes the first of equal holders then picks the same
        # one in every router replica and every run.
        return {r: result[r] for r in sorted(result)}

    def _drop_owner(self, key: int, replica: str) -> None:
        owners = self._owners.get(key)
        if owners is not None:
            owners.discard(replica)
            if not owners:
                del self._owners[key]
