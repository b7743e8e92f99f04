"""Cache-pressure-aware admission: which turns run now and which wait, so that the
conversations an engine is serving keep their KV cache.

When the live conversations' histories outgrow an engine's KV cache, vLLM admits every
request it is sent and evicts cached blocks least-recently-used to make room: a stream of
new conversations pushes out the history of every conversation in its think time, and each
next turn prefills its whole history again, whichever router places it (the figures:
docs/results.md, "Users' chats under eviction"; docs/log/gpu-kv-hierarchy.md). Here the
router keeps, per engine, the tokens of

  * its running requests (what they add to the cache: their output, and the prompts of
    requests without a session),
  * the histories of its live conversations (a turn in flight or finished less than
    `idle_s` ago, by the session header), each without the prefixes it shares, and
  * the prefixes its live conversations share (a system or tool prompt: cached once, so
    counted once, as their union, and by each router replica for its share of the cache;
    routing/shared_prefixes.py). What a conversation finds cached that no live one shares
    (its own history back after its window, what one gone since left) is its own; a
    conversation that brought a prefix counts it as its own until a later one is found to
    share it,

and admits a new conversation
(or one moving in) only where running + live histories + shared prefixes + what it adds fits
the engine's KV capacity, and a live conversation's next turn where running +
its new tokens fit: continuing conversations get in first, new ones wait until a
conversation goes quiet, in the order they came. (Live histories that outgrow the cache by
themselves still evict each other; admission only stops newcomers from adding to that.) An
engine with nothing running admits anything, and a request bigger than the budget by itself
goes at once (progress). Several router replicas each budget their share of every cache:
the front door spreads sessions evenly over them, and each sees only its own.

An engine with a host-memory KV tier (engine.kv_offload) keeps the histories of quiet
conversations there: evicting them from HBM costs a reload (a copy, a fraction of a
prefill: docs/results.md, "The KV hierarchy"), not a recompute. There, by default
(router.kv_admission_protect: auto), only the histories of conversations with a turn in
flight are protected, every request needs its whole prompt in HBM (a reload occupies HBM
blocks like a prefill), and continuing conversations still go first; `live` keeps the strict
rule above on such engines too.

What fits is judged on today's histories, but a conversation's history grows with every
turn: newcomers admitted up to a nearly full cache later outgrow it together and evict each
other, while a lower fill keeps their histories at the cost of new conversations waiting
longer (docs/log/gpu-kv-hierarchy.md). Hence the ceiling
`router.kv_admission_fill` (unset: 0.7 on an engine without a host tier, 0.95 on one with,
where a history pushed out of HBM is reloaded, not recomputed), and below it a fill that
adapts per engine: when a live conversation's next turn finds most of what it continues
gone from its engine, the engine's fill backs off; each turn that finds it kept raises the
fill again. Histories in a host tier count as kept. Only an index that follows the
engines' KV events (`events`) can tell; the `predicted` index learns nothing. Each router
learns from its own conversations; an engine whose cache is emptied (a restart, a reset)
reads as losses for the conversations that come back to it.

By default (router.kv_admission: auto) the ceiling is where an engine's fill starts, not
where it stops: while its live conversations come back to find their histories kept, the
fill climbs on past the ceiling, up to the whole cache, so a fleet whose histories fit holds
nothing back for long; one history lost brings the fill back under the ceiling at once.
`true`, or a set fill, keeps the ceiling as a cap. The start is cautious because the first wave of
conversations is admitted before any of them comes back to say what growth did (the
benchmark's 16 or 128 conversations start at once).

A conversation is live for `idle_s` after its last turn; unset (the default), for twice the
90th percentile of the pauses the router has seen between a conversation's turns (its
clients' think time, learned), within [IDLE_MIN_S, IDLE_MAX_S]: a history is protected as
long as its next turn is likely still to come, not a fixed guess longer.

Pure bookkeeping: the server (rayattn/server/forwarding/candidates.py) holds waiting
requests and wakes them, continuing conversations first, when load is released.
"""

from __future__ import annotations

import time
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from rayattn.routing.shared_prefixes import SharedPrefixes

DEFAULT_OUTPUT_TOKENS = 256
"""Output a request is expected to add when it names no max_tokens."""

HBM_FILL = 0.7
"""The ceiling (router.kv_admission_fill unset) on an engine without a host tier."""
HOST_TIER_FILL = 0.95
"""...and on one with a host tier, where a history pushed out of HBM is reloaded."""

IDLE_DEFAULT_S = 5.0
"""How long a quiet conversation stays live (router.conversation_idle_s unset) until enough
pauses have been seen to learn it."""
IDLE_MIN_S, IDLE_MAX_S = 1.0, 60.0
"""The bounds of the learned live window: a pause shorter than a second is a client's
round trip, and a history protected for over a minute holds newcomers back for a guess."""
IDLE_FACTOR = 2.0
"""The learned window is this many times the 90th percentile pause: most next turns come
well inside it, a conversation that ended stops holding room soon after."""
GAPS_KEPT, GAPS_TO_LEARN = 256, 16
"""Pauses kept (the newest), and how many are needed before the window is learned."""

FILL_BACKOFF = 0.9
"""An engine's fill is multiplied by this when a live history was lost there."""
FILL_RECOVERY = 0.002
"""...and raised by this (up to the ceiling; with router.kv_admission auto and no fill set,
up to the whole cache) for each live history kept. Kept histories
are the common case: at this rate a loss in about 1 of 50 turns holds the fill where it is,
and an engine recovers from 0.6 to 0.95 over some 175 kept turns."""
FILL_FLOOR = 0.3
"""The lowest fill an engine backs off to (histories that outgrow the cache by themselves
evict each other whatever admission does)."""
LOST = 0.5
"""A history counts as lost when less than this share of what its next turn continues is
predicted cached: LRU evicts a freed request's blocks tail first, so a history under
pressure loses its end before its start, and a single evicted block is not pressure."""


@dataclass
class _Conversation:
    replica: str
    tokens: int
    last_seen: float
    running: int = 0
    shared: int = 0
    """Tokens of its history that were cached on `replica` before it came (a system or tool
    prompt other conversations share), or that a conversation that came later was found to
    share with it: they are in the cache once for all of them."""
    keys: Sequence[int] = ()
    """Its first prompt's block keys on `replica` (while live): a conversation that comes
    later and finds a longer prefix of them cached than this one shares tells it that it
    brought that much for both."""
    prefix: tuple[int, int] | None = None
    """The shared prefix it uses (routing/shared_prefixes.py): its last block's key and its
    blocks, the first of `keys`."""

    @property
    def own(self) -> int:
        """Its history's tokens that are its alone (what admission reserves for it)."""
        return self.tokens - self.shared


class KVBudget:
    def __init__(self, idle_s: float | None = None, fill: float | None = None,
                 clock: Callable[[], float] = time.monotonic, protect: str = "auto",
                 climbs: bool = False, routers: Callable[[], int] = lambda: 1,
                 block_size: Callable[[], int] = lambda: 16) -> None:
        """`climbs`: router.kv_admission auto (see the module doc); `routers`: the router
        replicas sending to the engines, this one included (LoadTracker.routers);
        `block_size`: the engines' (a shared prefix is whole blocks; the first engine up
        may change it)."""
        self.block_size = block_size
        self.idle_s, self._clock = idle_s, clock
        """router.conversation_idle_s (None: learned, see window_s)."""
        self.climbs = climbs
        self.routers = routers
        self.fill = fill
        """router.kv_admission_fill: the ceiling of every engine's fill (None: by its tier,
        see ceiling())."""
        self.protect = protect
        """router.kv_admission_protect: auto, live or running."""
        self.capacity: dict[str, int] = {}
        """KV tokens each engine holds (its blocks × block size)."""
        self.running: Counter[str] = Counter()
        """Per engine: tokens its running requests add to the cache."""
        self.reserved: Counter[str] = Counter()
        """Per engine: tokens of its live conversations' histories."""
        self.active: Counter[str] = Counter()
        """Per engine: tokens of the histories of conversations with a turn in flight."""
        self.host_tier: set[str] = set()
        """Engines with a host-memory KV tier."""
        self.prefixes = SharedPrefixes(block_size)
        """Per engine: the prefixes its live conversations share, counted once."""
        self._origins: dict[tuple[str, int], set[str]] = {}
        """(engine, first block key) -> the live conversations new there that began with
        it: one of them may have brought a prefix others come to share."""
        self._backoff: dict[str, float] = {}
        """Per engine: its fill now as a share of its ceiling (see the module doc; a share,
        so a new ceiling applies at once)."""
        self._live: OrderedDict[str, _Conversation] = OrderedDict()
        """By last activity, oldest first."""
        self._gone: OrderedDict[str, _Conversation] = OrderedDict()
        """Conversations no longer live (the newest GAPS_KEPT × 16), as they were last: a
        turn that comes back after the window still teaches it the pause, and keeps what
        it shared on its engine (its own history there is not a prefix others left)."""
        self._gaps: deque[float] = deque(maxlen=GAPS_KEPT)
        self._new_gaps = 0
        self._window_s = IDLE_DEFAULT_S

    # --- membership ---------------------------------------------------------------------
    def joined(self, replica: str, capacity_tokens: int, host_tier: bool = False) -> None:
        self.capacity[replica] = capacity_tokens
        if host_tier:
            self.host_tier.add(replica)
        else:
            self.host_tier.discard(replica)

    def left(self, replica: str) -> None:
        # `running` stays: requests still running there end later (and a replica marked
        # down may rejoin under its name); dropping it here would leave it negative.
        self.capacity.pop(replica, None)
        self._backoff.pop(replica, None)
        self.reserved.pop(replica, None)
        self.active.pop(replica, None)
        self.host_tier.discard(replica)
        for s in [s for s, c in self._live.items() if c.replica == replica]:
            self._drop(s, self._live.pop(s))
        self.prefixes.forget(replica)

    # --- queries ------------------------------------------------------------------------
    def ceiling(self, replica: str) -> float:
        """Where `replica`'s fill starts, and the most it admits up to but where it climbs
        (router.kv_admission auto with no fill set: up to the whole cache)."""
        if self.fill is not None:
            return self.fill
        return HOST_TIER_FILL if replica in self.host_tier else HBM_FILL

    def fill_of(self, replica: str) -> float:
        """The fraction of `replica`'s KV cache admission admits up to now."""
        top, backoff = self.ceiling(replica), self._backoff.get(replica, 1.0)
        if not (self.climbs and self.fill is None):
            backoff = min(backoff, 1.0)  # a cap again (switched live from auto)
        return max(min(FILL_FLOOR, top), top * backoff)

    @property
    def share(self) -> float:
        """The share of every engine's cache this router budgets: 1 / the router replicas
        sending to the engines (the front door spreads sessions evenly over them; each sees
        only its own conversations and requests)."""
        return 1.0 / self.routers()

    @property
    def window_s(self) -> float:
        """How long after its last turn a conversation stays live."""
        return self.idle_s if self.idle_s is not None else self._window_s

    def is_live(self, session: str | None) -> bool:
        self._expire()
        return session is not None and session in self._live

    def arrived(self, session: str | None) -> bool:
        """A turn of `session` arrives (once per request): learns the pause since the
        conversation's last turn; returns whether it is live."""
        self._expire()
        if session is None:
            return False
        conv = self._live.get(session)
        gone = self._gone.get(session) if conv is None else None  # dispatched() drops it
        last = gone.last_seen if gone is not None \
            else conv.last_seen if conv is not None and not conv.running else None
        if last is not None and self.idle_s is None:
            self._learn_gap(self._clock() - last)
        return conv is not None

    def keep_pauses(self, other: KVBudget) -> None:
        """The pauses `other` learned (a cold start keeps what it knows of the clients)."""
        self._gaps, self._window_s = other._gaps, other._window_s

    def _learn_gap(self, gap: float) -> None:
        if gap > IDLE_MAX_S:
            return  # a conversation resumed, not a pause within one
        self._gaps.append(gap)
        self._new_gaps += 1
        if len(self._gaps) >= GAPS_TO_LEARN and self._new_gaps >= GAPS_TO_LEARN // 2:
            self._new_gaps = 0
            ordered = sorted(self._gaps)
            p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
            self._window_s = min(IDLE_MAX_S, max(IDLE_MIN_S, IDLE_FACTOR * p90))

    def adds(self, replica: str, session: str | None, prompt_tokens: int,
             max_tokens: int, cached_tokens: int = 0) -> int:
        """Tokens a request would add to `replica`'s cache: its prompt past what is cached
        there (the history its conversation holds there, a prefix others share:
        `cached_tokens`), and its output."""
        conv = self._live.get(session) if session else None
        return max(0, prompt_tokens - max(_held(conv, replica), cached_tokens)) + max_tokens

    def room(self, candidates: list[str], session: str | None, prompt_tokens: int,
             max_tokens: int, cached: Mapping[str, int] | None = None,
             keys: Sequence[int] = ()) -> list[str]:
        """The candidates that can take the request now without pushing a live
        conversation's history out of their cache. `cached`: tokens of the prompt each
        candidate has cached; `keys`: the prompt's block keys (which prefix that is). A
        request bigger than this router's budget of every candidate by itself goes at once:
        waiting cannot make room for it."""
        self._expire()
        conv = self._live.get(session) if session else None
        cached = cached or {}
        gone = self._gone.get(session) if session and conv is None else None
        out = [r for r in candidates
               if self._fits(r, conv, prompt_tokens, max_tokens, cached.get(r, 0), keys,
                             gone is not None and gone.replica == r)]
        if not out and candidates and all(
                self._need(r, conv, prompt_tokens, max_tokens, cached.get(r, 0))
                > self.budget(r) for r in candidates):
            return list(candidates)
        if conv is not None and conv.replica in candidates and conv.replica not in out:
            # A live conversation waits for the engine that holds its history rather than
            # moving only because another has room: there it would recompute all of it (and
            # with a host tier, letting turns move cost much of the hit rate). Once it fits
            # at home, moving is the policy's call again.
            return []
        return out

    def _need(self, r: str, conv: _Conversation | None, prompt_tokens: int,
              max_tokens: int, cached_tokens: int) -> int:
        """Tokens of `r`'s HBM the request takes: its prompt past what `r` caches (its
        conversation's history there, a prefix others left), and its output; with a host
        tier (protect `running`), its whole prompt: what the host tier holds is reloaded
        into HBM blocks."""
        if self._protects_running_only(r):
            return prompt_tokens + max_tokens
        return max(0, prompt_tokens - max(_held(conv, r), cached_tokens)) + max_tokens

    def _fits(self, r: str, conv: _Conversation | None, prompt_tokens: int,
              max_tokens: int, cached_tokens: int, keys: Sequence[int] = (),
              back: bool = False) -> bool:
        """`back`: the conversation comes back to `r` after its window (what it finds
        cached there is its own history)."""
        cap = self.capacity.get(r)
        if cap is None or not self.running[r]:
            return True
        if self._protects_running_only(r):
            # Quiet histories are safe in the host tier: protect only those in use.
            own = conv.own if conv is not None and conv.replica == r and \
                conv.running else 0
            # The shared prefixes too: the conversations using them run most of the time.
            protected = self.active[r] - own + self.prefixes.tokens(r) * self.share
        else:
            # A conversation live here only has to fit next to what runs: the live
            # histories are what admission protects from newcomers, not from each
            # other.
            if conv is not None and conv.replica == r:
                protected = 0.0
            else:
                # As it comes, a prefix it shares with live conversations that brought it is
                # counted once, apart (its share of it), and no longer in their histories.
                blocks, bringers = self._sharing(r, keys, min(cached_tokens, prompt_tokens),
                                                 back)
                added = 0
                if bringers:
                    added = (blocks - self.prefixes.inside(r, keys, blocks)) * self.block_size()
                protected = self.reserved[r] - sum(m for _, m in bringers) + \
                    (self.prefixes.tokens(r) + added) * self.share
        need = self._need(r, conv, prompt_tokens, max_tokens, cached_tokens)
        return self.running[r] + protected + need <= self.budget(r)

    def budget(self, replica: str) -> float:
        """Tokens of `replica`'s cache this router admits up to now (its fill of this
        router's share; unbounded for an engine of unknown capacity)."""
        cap = self.capacity.get(replica)
        return float("inf") if cap is None else self.fill_of(replica) * cap * self.share

    def _protects_running_only(self, replica: str) -> bool:
        if self.protect == "auto":
            return replica in self.host_tier
        return self.protect == "running"

    # --- lifecycle ----------------------------------------------------------------------
    def dispatched(self, replica: str, session: str | None, prompt_tokens: int,
                   max_tokens: int, continued: tuple[int, int] | None = None,
                   cached_tokens: int = 0, keys: Sequence[int] = ()) -> int:
        """A request is sent to `replica`; returns the running tokens it holds until
        `ended`. `continued`: (tokens it shares with its conversation's previous prompt and
        answer, tokens the router's index predicts cached there), for the fill to learn
        whether the history was kept; None: nothing to learn from. `cached_tokens`: of its
        prompt, predicted cached there (a conversation new there shares that much); `keys`:
        its prompt's block keys (which prefix that is)."""
        now = self._clock()
        if not session:
            held = prompt_tokens + max_tokens
        else:
            if continued is not None and continued[0] > 0:
                self._expire()  # only a conversation live now teaches (room() expires too)
            conv = self._live.pop(session, None)
            gone = self._gone.pop(session, None)  # live again
            # A live conversation back at its engine with no turn of it in flight (an
            # earlier turn still running has not been indexed yet): was its history kept?
            if conv is not None and conv.replica == replica and not conv.running and \
                    continued is not None and continued[0] > 0:
                self._learn(replica, kept=continued[1] >= continued[0] * LOST)
            home = conv is not None and conv.replica == replica and \
                conv.shared <= prompt_tokens
            if conv is not None:
                self.reserved[conv.replica] -= conv.own
                if conv.running:
                    self.active[conv.replica] -= conv.own
                if not home:
                    self._drop(session, conv)
            running = conv.running if conv is not None else 0
            if home:
                # Back home: it shares what it shared (still held for it); the rest of its
                # history is its own.
                new = _Conversation(replica, prompt_tokens, now, running + 1, conv.shared,
                                    conv.keys, conv.prefix)
            else:
                # New here (or its history cut short of what it shared): of what it finds
                # cached, what live conversations share is shared, the rest (its own history
                # back after its window, or what a conversation gone since left) its own.
                new = _Conversation(replica, prompt_tokens, now, running + 1, 0,
                                    array("Q", keys))
                blocks = self._found_shared(replica, keys, min(cached_tokens, prompt_tokens),
                                            gone is not None and gone.replica == replica)
                if blocks:
                    new.shared = blocks * self.block_size()
                    new.prefix = (keys[blocks - 1], blocks)
                self._hold(session, new)
            # The prompt (the history and the new turn) becomes the conversation's; the
            # output is running until the turn ends.
            self._live[session] = conv = new
            self.reserved[replica] += conv.own
            self.active[replica] += conv.own
            held = max_tokens
        self.running[replica] += held
        return held

    def _learn(self, replica: str, kept: bool) -> None:
        """A live conversation's next turn at home found its history kept or lost."""
        top = self.ceiling(replica)
        share = self._backoff.get(replica, 1.0)
        if kept:
            # auto, unset fill: past the ceiling up to the whole cache while kept.
            most = 1.0 / top if self.climbs and self.fill is None else 1.0
            share = min(most, share + FILL_RECOVERY / top)
        else:
            share = max(min(1.0, FILL_FLOOR / top), min(share, 1.0) * FILL_BACKOFF)
        self._backoff[replica] = share

    def _sharing(self, replica: str, keys: Sequence[int], tokens: int, back: bool = False
                 ) -> tuple[int, list[tuple[str, int]]]:
        """A conversation new on `replica` finds `tokens` of its prompt (`keys`) cached
        there: how many blocks of it are a prefix it shares with live conversations, and
        those of them that brought part of it and counted that as their own history (they
        began with it, nothing of it was counted shared then), with how much each counted.
        Bringers are looked for only where the prefix is not counted yet, and not for a
        conversation `back` after its window (what it finds is its own history): every
        prompt that begins alike (a chat template's first block) is looked through."""
        n = min(tokens // self.block_size(), len(keys))
        if n == 0 or back or self.prefixes.holds(replica, keys[n - 1]):
            return n, []
        size, key = n * self.block_size(), keys[n - 1]  # chained keys: the whole prefix
        bringers = []
        for s in self._origins.get((replica, keys[0]), ()):
            c = self._live[s]
            moved = min(size, c.tokens) - c.shared
            if moved > 0 and len(c.keys) >= n and c.keys[n - 1] == key:
                bringers.append((s, moved))
        return n, bringers

    def _found_shared(self, replica: str, keys: Sequence[int], tokens: int,
                      back: bool = False) -> int:
        """`_sharing`, applied: what the bringers brought is shared from now on, theirs no
        longer. Returns the blocks of the shared prefix the newcomer uses: all it found
        cached where that is counted or was brought by live conversations, else the part
        of it in the union."""
        n, bringers = self._sharing(replica, keys, tokens, back)
        for s, moved in bringers:
            conv = self._live[s]
            self._drop(s, conv)
            conv.shared += moved
            self.reserved[replica] -= moved
            if conv.running:
                self.active[replica] -= moved
            conv.prefix = (keys[n - 1], n)
            self._hold(s, conv)
        return n if n and self.prefixes.holds(replica, keys[n - 1]) else \
            self.prefixes.inside(replica, keys, n)

    def _hold(self, session: str, conv: _Conversation) -> None:
        """`conv` is live: it may bring a prefix others come to share, and it uses the
        prefix it shares."""
        if conv.keys:
            self._origins.setdefault((conv.replica, conv.keys[0]), set()).add(session)
        if conv.prefix is not None:
            self.prefixes.use(conv.replica, conv.keys, conv.prefix[1])

    def _drop(self, session: str, conv: _Conversation) -> None:
        """`conv` is no longer live (or is about to be replaced): undoes `_hold`."""
        if conv.prefix is not None:
            self.prefixes.release(conv.replica, conv.prefix[0])
        if conv.keys:
            origins = self._origins.get((conv.replica, conv.keys[0]))
            if origins is not None:
                origins.discard(session)
                if not origins:
                    del self._origins[(conv.replica, conv.keys[0])]

    def finished(self, replica: str, session: str | None, context_tokens: int) -> None:
        """The turn ran to its end: the conversation's history is now `context_tokens`."""
        conv = self._live.get(session) if session else None
        if conv is not None and conv.replica == replica:
            own = conv.own
            if context_tokens < conv.shared:
                # Cut short of what it shared (a client trimmed it, a stale turn): it
                # shares nothing now.
                self._drop(session, conv)
                conv.shared, conv.prefix = 0, None
                self._hold(session, conv)
            conv.tokens = context_tokens
            self.reserved[replica] += conv.own - own
            if conv.running:
                self.active[replica] += conv.own - own

    def ended(self, replica: str, session: str | None, held: int) -> None:
        self.running[replica] -= held
        conv = self._live.get(session) if session else None
        if conv is not None:
            if conv.running == 1:
                self.active[conv.replica] -= conv.own
            conv.running = max(0, conv.running - 1)
            conv.last_seen = self._clock()
            self._live.move_to_end(session)

    def _expire(self) -> None:
        cutoff = self._clock() - self.window_s
        # Oldest first, up to the first one seen within the window: not a copy of every
        # live conversation per request (thousands of them on a busy router).
        expired = []
        for s, conv in self._live.items():
            if conv.last_seen > cutoff:
                break  # the rest are newer
            if not conv.running:
                expired.append(s)
        for s in expired:
            conv = self._live.pop(s)
            self._drop(s, conv)
            conv.keys, conv.prefix = (), None  # a gone conversation brings nothing back
            self.reserved[conv.replica] -= conv.own
            if self.idle_s is None:
                self._gone.pop(s, None)  # newest last
                self._gone[s] = conv
                if len(self._gone) > GAPS_KEPT * 16:
                    self._gone.popitem(last=False)


def _held(conv: _Conversation | None, replica: str) -> int:
    """Tokens of `conv`'s history cached on `replica`."""
    return conv.tokens if conv is not None and conv.replica == replica else 0
