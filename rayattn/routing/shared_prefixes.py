"""The prefixes live conversations share on each engine (a system prompt, an agent's tool
prompt, a document several chats ask about), for cache-pressure admission
(routing/kv_budget.py): each is in the engine's cache once, so it is counted once, however
many conversations use it, and nested or branching prefixes (a common system prompt under
several tool prompts) count the tokens of their union.

A prefix is named by the key of its last block. Block keys are chained (each hashes its
parent), so one key names the whole prefix, the union of several prefixes is the set of
their blocks' keys, and the blocks of a prompt in that union are a run from its start.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class _Prefix:
    keys: Sequence[int]
    users: int = 0


class SharedPrefixes:
    def __init__(self, block_size: Callable[[], int] = lambda: 16) -> None:
        self.block_size = block_size
        self._by_replica: dict[str, dict[int, _Prefix]] = {}
        self._blocks: dict[str, Counter[int]] = {}
        """Per replica: each block key of the union, with the prefixes that hold it."""

    def tokens(self, replica: str) -> int:
        """Tokens the prefixes on `replica` take in its cache, each counted once."""
        return len(self._blocks.get(replica, ())) * self.block_size()

    def holds(self, replica: str, key: int) -> bool:
        """Whether the prefix whose last block is `key` is counted on `replica`."""
        return key in self._by_replica.get(replica, {})

    def inside(self, replica: str, keys: Sequence[int], blocks: int) -> int:
        """How many of the first `blocks` blocks of `keys` lie in the union on `replica`
        (a run from the start: found by bisection)."""
        union = self._blocks.get(replica)
        if not union:
            return 0
        lo, hi = 0, min(blocks, len(keys))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if keys[mid - 1] in union:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def use(self, replica: str, keys: Sequence[int], blocks: int) -> int:
        """A live conversation uses the prefix of `keys`' first `blocks` blocks; returns the
        prefix's name (its last block's key) for `release`."""
        held = self._by_replica.setdefault(replica, {})
        key = keys[blocks - 1]
        p = held.get(key)
        if p is None:
            p = held[key] = _Prefix(array("Q", keys[:blocks]))
            self._blocks.setdefault(replica, Counter()).update(p.keys)
        p.users += 1
        return key

    def release(self, replica: str, key: int) -> None:
        """A conversation that used the prefix `key` is no longer live there."""
        held = self._by_replica.get(replica, {})
        p = held.get(key)
        if p is None:
            return
        p.users -= 1
        if p.users <= 0:
            del held[key]
            union = self._blocks[replica]
            union.subtract(p.keys)
            for k in p.keys:
                if union[k] <= 0:
                    del union[k]

    def forget(self, replica: str) -> None:
        self._by_replica.pop(replica, None)
        self._blocks.pop(replica, None)
