"""The prefixes live conversations share on each engine (a system prompt, an agent's tool
prompt, a document several chats ask about), for cache-pressure admission
(routing/kv_budget.py): each is in the engine's cache once, so it is counted once, however
many conversations use it, and nested or branching prefixes (a common system prompt under
several tool prompts) count the tokens of their union.

A prefix is named by the key of its last block: block keys are chained (each hashes its
parent), so one key names the whole prefix, and two prefixes begin alike for exactly as many
blocks as their keys agree.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class _Prefix:
    tokens: int
    blocks: int
    keys: Sequence[int]
    """Its block keys (at least `blocks` of them): what tells which prefixes lie inside it."""
    users: int = 0


class SharedPrefixes:
    def __init__(self) -> None:
        self._by_replica: dict[str, dict[int, _Prefix]] = {}
        self._union: dict[str, int] = {}
        """Per replica: the tokens of the union of its prefixes (recounted on every change:
        prefixes come and go far less often than requests)."""

    def tokens(self, replica: str) -> int:
        """Tokens the prefixes on `replica` take in its cache, each counted once."""
        return self._union.get(replica, 0)

    def holds(self, replica: str, key: int) -> bool:
        """Whether the prefix whose last block is `key` is counted on `replica`."""
        return key in self._by_replica.get(replica, {})

    def added_by(self, replica: str, keys: Sequence[int], blocks: int, block_size: int) -> int:
        """Tokens the union on `replica` would grow by with the prefix of `keys`' first
        `blocks` blocks: what lies past the longest start it has in common with one there
        (none where it is one already or lies inside one)."""
        held = self._by_replica.get(replica, {}).values()
        common = max((_common(keys, blocks, p.keys, p.blocks) for p in held), default=0)
        return (blocks - common) * block_size

    def use(self, replica: str, keys: Sequence[int], blocks: int, block_size: int) -> int:
        """A live conversation uses the prefix of `keys`' first `blocks` blocks; returns the
        prefix's name (its last block's key) for `release`."""
        held = self._by_replica.setdefault(replica, {})
        key = keys[blocks - 1]
        p = held.get(key)
        if p is None:
            p = held[key] = _Prefix(blocks * block_size, blocks, array("Q", keys[:blocks]))
            self._recount(replica)
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
            self._recount(replica)

    def forget(self, replica: str) -> None:
        self._by_replica.pop(replica, None)
        self._union.pop(replica, None)

    def _recount(self, replica: str) -> None:
        # The union of paths from one root: each adds what lies past the longest start it
        # has in common with one counted before it, in any order.
        held = list(self._by_replica.get(replica, {}).values())
        total = 0
        for i, b in enumerate(held):
            common = max((_common(b.keys, b.blocks, a.keys, a.blocks) for a in held[:i]),
                         default=0)
            total += (b.blocks - common) * (b.tokens // b.blocks)
        self._union[replica] = total


def _common(a: Sequence[int], a_blocks: int, b: Sequence[int], b_blocks: int) -> int:
    """Leading blocks two prefixes have in common. Chained keys: equal at a position means
    equal up to it, so the first difference is found by bisection."""
    lo, hi = 0, min(a_blocks, b_blocks)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo
