"""Per replica, the blocks of its host-memory KV tier (vLLM's offloading connector), as the
engines' KV events announce them (EventIndex's second tier)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


class HostTier:
    def __init__(self) -> None:
        self._host: dict[str, Counter[int]] = {}
        """Per replica, its host tier's blocks, counted: a block announced by several
        offloaded chunks leaves with the last of them."""

    def add_replica(self, replica: str) -> None:
        self._host.setdefault(replica, Counter())

    def remove_replica(self, replica: str) -> None:
        self._host.pop(replica, None)

    def size(self, replica: str) -> int:
        return len(self._host.get(replica, ()))

    def stored(self, replica: str, keys: Sequence[int]) -> None:
        self._host[replica].update(keys)

    def removed(self, replica: str, keys: Sequence[int]) -> None:
        host = self._host.get(replica)
        for key in keys if host is not None else ():
            if host[key] <= 1:
                host.pop(key, None)
            else:
                host[key] -= 1

    def extend(self, keys: Sequence[int], held: dict[str, int]) -> dict[str, int]:
        """Past each replica's `held` leading blocks (its GPU hit), the run of `keys` its host
        tier holds: vLLM's scheduler looks there only past the GPU hit and reloads those
        blocks. Extends `held` in place; returns the reloaded blocks per replica."""
        reloaded: dict[str, int] = {}
        for replica, host in self._host.items():
            if not host:
                continue
            start = end = held.get(replica, 0)
            while end < len(keys) and keys[end] in host:
                end += 1
            if end > start:
                held[replica], reloaded[replica] = end, end - start
        return reloaded
