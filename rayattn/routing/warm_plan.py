"""What to prefill on engines that come and go, from the conversations the router remembers
(routing/known_prefixes.py: each one's last prompt and answer, with their blocks' hashes).

- **A joining engine** gets the prefixes most conversations share (a system prompt, an agent's
  tool prompt, a document many users ask about) before it takes conversations: its first
  ones then run the extend path, not a full prefill.
- **A leaving engine's** live conversations (scale-down, a rolling update) are prefilled where
  their next turns will go, most recent first: the next turn finds its history instead of
  paying for it.

Both within a share of the destination's KV cache (of this router's share of it: every router
warms for its own conversations), so warming never pushes out more than it brings. Pure: the
server's fleet (server/fleet/warming.py) sends the prefills."""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

WARM_SHARE = 0.25
"""Of a joining engine's KV cache, what its shared prefixes may take."""
MOVE_SHARE = 0.5
"""Of the staying engines' KV cache, what a leaving engine's conversations may take."""
RECENT_CONVERSATIONS = 256
"""Conversations looked at for shared prefixes (the most recent)."""
SHARED_BLOCKS = 512
"""Of each, the leading blocks looked at: at most 256 × 512 hashes counted on the router's
loop when an engine joins."""
LIVE_S = 600.0
"""How far back the decision log is searched for a leaving engine's conversations; of those,
only the ones the KV budget holds live are moved (routing/kv_budget.py: the pause the router
learned from its clients, at most a minute, or router.conversation_idle_s)."""


@dataclass(frozen=True)
class Prefill:
    ids: array
    """Token ids: `tokens` of them are prefilled (an array kept by KnownPrefixes, not a
    copy)."""
    tokens: int
    session: str | None = None
    """The conversation moved (None: a prefix several share)."""
    sessions: int = 1
    """Conversations that share it."""
    salt: str | None = None
    """Its cache namespace (vLLM's `cache_salt`): the prefill must hash as its turns do."""
    at: float | None = None
    """A moved conversation's: when its last turn was routed (a later turn makes the move
    moot)."""

    def token_ids(self) -> list[int]:
        return self.ids[: self.tokens].tolist()


@dataclass(frozen=True)
class Shared:
    """A prefix several conversations share, the longest that they do."""

    prefill: Prefill
    chain: list[bytes]
    """Its blocks' hashes."""


def shared_prefixes(histories: Iterable[tuple[array, list[bytes], str | None]],
                    block_size: int) -> list[Shared]:
    """The longest prefixes (whole blocks) at least two of `histories` share, the most widely
    shared first (what new conversations will need: the live ones' system or tool prompt
    before a document two old ones shared), then the longest. A block's hash names its
    whole prefix (vLLM chains them, the cache namespace included), so counting hashes counts
    the conversations that share each prefix."""
    histories = [(ids, hashes[:SHARED_BLOCKS], salt) for ids, hashes, salt in histories]
    count: Counter[bytes] = Counter()
    for _, hashes, _ in histories:
        count.update(hashes)
    deepest: dict[bytes, Shared] = {}
    for ids, hashes, salt in histories:
        depth = 0
        while depth < len(hashes) and count[hashes[depth]] >= 2:
            depth += 1
        if depth and hashes[depth - 1] not in deepest:
            deepest[hashes[depth - 1]] = Shared(
                Prefill(ids, depth * block_size, None, count[hashes[depth - 1]], salt),
                hashes[:depth])
    return sorted(deepest.values(), key=lambda s: (-s.prefill.sessions, -s.prefill.tokens))


def within(shared: list[Shared], block_size: int, budget_tokens: int) -> list[Prefill]:
    """Of `shared` (shared_prefixes' order), what fits in `budget_tokens`: the last one cut to
    its leading blocks that do (shared as widely); one that a chosen prefix contains is left
    out."""
    chosen: list[Prefill] = []
    covered: set[bytes] = set()
    used = 0
    for s in shared:
        blocks = min(len(s.chain), (budget_tokens - used) // block_size)
        if blocks <= 0 or s.chain[blocks - 1] in covered:
            continue
        p = s.prefill
        chosen.append(Prefill(p.ids, blocks * block_size, None, p.sessions, p.salt))
        used += blocks * block_size
        covered.update(s.chain[:blocks])
    return chosen


def moves(conversations: Iterable[tuple[str, float, array, str | None]],
          block_size: int, budget_tokens: int) -> list[Prefill]:
    """Of a leaving engine's conversations (most recent first, with their last turn's time,
    the token ids each sent last and its cache salt), those to prefill elsewhere, within
    `budget_tokens`; one shorter than a block would cache nothing."""
    out, used = [], 0
    for session, at, ids, salt in conversations:
        if len(ids) < block_size or used + len(ids) > budget_tokens:
            continue
        out.append(Prefill(ids, len(ids), session, salt=salt, at=at))
        used += len(ids)
    return out
