"""What to prefill on engines that come and go, from the conversations the router remembers
(routing/known_prefixes.py: each one's last prompt and answer, with their blocks' hashes).

- **A joining engine** gets the prefixes most conversations share (a system prompt, an agent's
  tool prompt, a document many users ask about) before it takes conversations: its first
  ones then run the extend path, not a full prefill.
- **A leaving engine's** live conversations (scale-down, a rolling update) are
  prefilled where their next turns will go, most recent first: the next turn finds its
  history instead of paying for it.

Both within a share of the destination's KV cache, so warming never pushes out more than it
brings. Pure: the server's fleet (server/fleet/warming.py) sends the prefills."""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

WARM_SHARE = 0.25
"""Of a joining engine's KV cache, what its shared prefixes may take."""
MOVE_SHARE = 0.5
"""Of the staying engines' KV cache, what a leaving engine's conversations may take."""
RECENT_CONVERSATIONS = 1024
"""Conversations looked at for shared prefixes (the most recent)."""
LIVE_S = 600.0
"""A conversation whose last turn is older than this is not moved (its client has likely
gone)."""


@dataclass(frozen=True)
class Prefill:
    token_ids: list[int]
    session: str | None = None
    """The conversation moved (None: a prefix several share)."""
    sessions: int = 1
    """Conversations that share it."""
    salt: str | None = None
    """Its cache namespace (vLLM's `cache_salt`): the prefill must hash as its turns do."""


def shared_prefixes(histories: Iterable[tuple[array, list[bytes], str | None]],
                    block_size: int, budget_tokens: int) -> list[Prefill]:
    """The longest prefixes (whole blocks) at least two of `histories` share, the most shared
    tokens first, within `budget_tokens` (the last one cut to what fits); one that a chosen
    prefix contains is left out. A
    block's hash names its whole prefix (vLLM chains them, cache namespace included), so
    counting hashes counts the conversations that share each prefix."""
    histories = list(histories)
    count: Counter[bytes] = Counter()
    for _, hashes, _ in histories:
        count.update(hashes)
    deepest: dict[bytes, tuple[Prefill, list[bytes]]] = {}
    for ids, hashes, salt in histories:
        depth = 0
        while depth < len(hashes) and count[hashes[depth]] >= 2:
            depth += 1
        if depth and hashes[depth - 1] not in deepest:
            deepest[hashes[depth - 1]] = (
                Prefill(list(ids[:depth * block_size]), None, count[hashes[depth - 1]], salt),
                hashes[:depth])
    chosen: list[Prefill] = []
    covered: set[bytes] = set()
    used = 0
    for h, (p, chain) in sorted(deepest.items(),
                                key=lambda kv: -kv[1][0].sessions * len(kv[1][0].token_ids)):
        if h in covered:
            continue
        # Where it does not fit whole, its leading blocks do as well (shared as widely).
        blocks = min(len(chain), (budget_tokens - used) // block_size)
        if blocks <= 0 or chain[blocks - 1] in covered:
            continue
        chosen.append(Prefill(p.token_ids[:blocks * block_size], None, p.sessions, p.salt))
        used += blocks * block_size
        covered.update(chain[:blocks])
    return chosen


def moves(conversations: Iterable[tuple[str, array, str | None]],
          budget_tokens: int) -> list[Prefill]:
    """Of a leaving engine's conversations (most recent first, with the token ids each sent
    last and its cache salt), those to prefill elsewhere, within `budget_tokens`."""
    out, used = [], 0
    for session, ids, salt in conversations:
        if used + len(ids) > budget_tokens:
            continue
        out.append(Prefill(list(ids), session, salt=salt))
        used += len(ids)
    return out
