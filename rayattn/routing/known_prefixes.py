"""The token ids recent conversations sent last, with their full blocks' hashes, so that a
conversation's next turn hashes only the blocks after what it shares with them."""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import NamedTuple

# Token ids of recent conversations' last prompt (+ answer) kept: 4-byte ids, 16M tokens =
# 64 MiB at most, however many conversations (client-chosen session ids) and however long
# their contexts.
KNOWN_PREFIX_TOKENS = 16 << 20


class Known(NamedTuple):
    """What a conversation sent last."""

    ids: array
    hashes: list[bytes]
    """Its full blocks' hashes."""
    salt: str | None = None
    """The cache namespace it was sent under (vLLM's `cache_salt`)."""
    adapter: str | None = None
    """The LoRA adapter it ran under."""


class KnownPrefixes:
    """Per conversation, its last token ids and their full blocks' hashes, bounded in tokens
    (least recently remembered dropped first)."""

    def __init__(self, block_size: int, budget_tokens: int = KNOWN_PREFIX_TOKENS) -> None:
        self.block_size = block_size
        self.budget_tokens = budget_tokens
        self._prefixes: OrderedDict[str, Known] = OrderedDict()
        self._tokens = 0

    @property
    def tokens(self) -> int:
        """Token ids kept, over all conversations."""
        return self._tokens

    def __len__(self) -> int:
        return len(self._prefixes)

    def get(self, session: str) -> Known | None:
        """What `session` sent last, if still kept."""
        return self._prefixes.get(session)

    def recent(self, n: int) -> list[Known]:
        """What the `n` conversations remembered last sent, the most recent first."""
        out = []
        for session in reversed(self._prefixes):
            if len(out) == n:
                break
            out.append(self._prefixes[session])
        return out

    def known(self, token_ids: list[int], session: str) -> list[bytes]:
        """The hashes of the leading full blocks `token_ids` shares with what `session` sent
        last."""
        entry = self._prefixes.get(session)
        if entry is None:
            return []
        ids, hashes = entry.ids, entry.hashes
        bs = self.block_size
        n = min(len(ids), len(token_ids)) // bs * bs
        try:
            if array("I", token_ids[:n]) == ids[:n]:
                return hashes[: n // bs]
        except OverflowError:  # not token ids this cache can hold
            return []
        # Diverged (an edited history, a re-tokenized answer): the blocks before the first
        # differing one still hold, found by halving.
        lo, hi = 0, n // bs
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if array("I", token_ids[: mid * bs]) == ids[: mid * bs]:
                lo = mid
            else:
                hi = mid - 1
        return hashes[:lo]

    def remember(self, session: str, token_ids: list[int], hashes: list[bytes],
                 salt: str | None = None, adapter: str | None = None) -> None:
        """`session` sent `token_ids` (whose full blocks hash to `hashes`) last, under cache
        salt `salt` and LoRA adapter `adapter`."""
        try:
            ids = array("I", token_ids)
        except OverflowError:  # an id beyond 32 bits: nothing to keep
            return
        old = self._prefixes.pop(session, None)
        if old is not None:
            self._tokens -= len(old.ids)
        if len(ids) > self.budget_tokens // 4:
            return  # one conversation may not take the whole budget
        self._prefixes[session] = Known(ids, hashes, salt, adapter)
        self._tokens += len(ids)
        while self._tokens > self.budget_tokens:
            _, dropped = self._prefixes.popitem(last=False)
            self._tokens -= len(dropped.ids)

    def clear(self, block_size: int | None = None) -> None:
        """Forget every conversation (their hashes are of another block size, when given)."""
        self._prefixes.clear()
        self._tokens = 0
        if block_size is not None:
            self.block_size = block_size
