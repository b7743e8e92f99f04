"""The router's own recent decisions as blocks it counts as cached before the engine says so
(EventIndex's overlay): a block sent to a replica counts there until the engine's event
confirms or removes it, or `ttl_s` passes."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence


class SpeculativeOverlay:
    def __init__(self, ttl_s: float = 30.0, clock: Callable[[], float] | None = None) -> None:
        self.ttl_s = ttl_s
        """For blocks sent from now on (a live settings change leaves earlier ones be)."""
        self._clock = clock or time.monotonic
        self._spec: dict[int, dict[str, float]] = {}
        """Block key -> the replicas it was sent to, with when it stops counting there."""
        # (expiry, key, replica) in insertion order, which is expiry order (one ttl, a
        # monotonic clock): swept on every insert, so unconfirmed blocks (unique prompts,
        # blocks evicted before their event) do not pile up.
        self._expiry: deque[tuple[float, int, str]] = deque()

    def insert(self, replica: str, keys: Sequence[int],
               owners: Callable[[int], set[str] | None]) -> None:
        """Requests carrying `keys` were sent to `replica`; `owners`: who holds a key in
        truth (a block the engine already holds needs no overlay)."""
        now = self._clock()
        self._sweep(now)
        exp = now + self.ttl_s
        for key in keys:
            held_by = owners(key)
            if held_by is None or replica not in held_by:
                self._spec.setdefault(key, {})[replica] = exp
                self._expiry.append((exp, key, replica))

    def owners(self, key: int, truth: set[str] | None) -> set[str] | None:
        """`truth`, the engines' owners of `key`, with the overlay's live ones (expired ones
        go)."""
        spec = self._spec.get(key)
        if not spec:
            return truth
        now = self._clock()
        live = {r for r, exp in spec.items() if exp > now}
        if len(live) < len(spec):
            for r in [r for r, exp in spec.items() if exp <= now]:
                self.drop(key, r)
        return (truth | live) if truth else live

    def count(self, replica: str) -> int:
        """Blocks counted on `replica` (live or not swept yet)."""
        return sum(1 for owners in self._spec.values() if replica in owners)

    def drop(self, key: int, replica: str) -> None:
        """The engine said where `key` is: the overlay's guess for `replica` is over."""
        owners = self._spec.get(key)
        if owners is not None:
            owners.pop(replica, None)
            if not owners:
                del self._spec[key]

    def forget(self, replica: str) -> None:
        for key in [k for k, owners in self._spec.items() if replica in owners]:
            self.drop(key, replica)

    def _sweep(self, now: float) -> None:
        q = self._expiry
        while q and q[0][0] <= now:
            exp, key, replica = q.popleft()
            spec = self._spec.get(key)
            if spec is not None and spec.get(replica) == exp:  # not renewed since
                self.drop(key, replica)
