"""What the core's decisions did to conversations: where each one's previous turn went, and
the router's own regret by the decision's reason (/health, the simulator's reports)."""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable

from rayattn.routing.policies import Decision, RouteRequest, cached_tokens

# Conversations whose last replica the core remembers (a name each).
LAST_REPLICAS = 100_000


class DecisionLog:
    def __init__(self, last_replicas: int = LAST_REPLICAS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._last_replicas = last_replicas
        self._clock = clock
        self._last_replica: OrderedDict[str, tuple[str, float]] = OrderedDict()
        """Where each recent conversation's previous turn went and when (bounded, oldest
        first)."""
        self.regret_tokens: Counter[str] = Counter()
        """By decision reason: prompt tokens recomputed that another candidate held."""
        self.session_moves: Counter[str] = Counter()
        """By decision reason: conversations sent elsewhere than their previous turn."""

    def previous(self, session: str) -> str | None:
        """Where `session`'s previous turn went, if it is remembered."""
        last = self._last_replica.get(session)
        return last[0] if last is not None else None

    def sessions_on(self, targets: set[str], within_s: float) -> list[tuple[str, float]]:
        """The conversations whose previous turn went to one of `targets` within the last
        `within_s` seconds, with that turn's time, the most recent first."""
        since, out = self._clock() - within_s, []
        for session, (replica, at) in reversed(self._last_replica.items()):
            if at < since:
                break
            if replica in targets:
                out.append((session, at))
        return out

    def last_turn(self, session: str) -> float | None:
        """When `session`'s previous turn was routed, if it is remembered."""
        last = self._last_replica.get(session)
        return last[1] if last is not None else None

    def moved(self, session: str, at: float, replica: str) -> None:
        """`session`'s history, as its turn routed at `at` left it, was prefilled on
        `replica` (that turn's engine left): its next turn's previous replica; nothing where
        a turn came meanwhile."""
        last = self._last_replica.get(session)
        if last is not None and last[1] == at:
            self._last_replica[session] = (replica, at)

    def record(self, d: Decision, route: RouteRequest, candidates: list[str],
               block_size: int, retry: bool) -> None:
        """`d` was chosen for `route` among `candidates`. A retry's choice (an earlier
        attempt's replica failed) is not the router's to account as a move or a regret."""
        if not retry:
            self._account(d, route, candidates, block_size)
        if route.session:
            self._last_replica[route.session] = (d.replica, self._clock())
            self._last_replica.move_to_end(route.session)
            if len(self._last_replica) > self._last_replicas:
                self._last_replica.popitem(last=False)

    def _account(self, d: Decision, route: RouteRequest, candidates: list[str],
                 block_size: int) -> None:
        """The router's own regret, by the decision's reason: prompt tokens another
        candidate held beyond the chosen one's, and conversations moved off the replica of
        their previous turn while it was a candidate."""
        matches = route.held or {}
        held = max((matches.get(r, 0) for r in candidates), default=0)
        best = cached_tokens(route.prompt_tokens, held, block_size)
        d.regret_tokens = max(0, best - d.predicted_cached_tokens)
        if d.regret_tokens:
            self.regret_tokens[d.reason] += d.regret_tokens
        if route.previous in candidates and route.previous != d.replica:
            d.moved_from = route.previous
            self.session_moves[d.reason] += 1

    def clear(self) -> None:
        """Cold start: no conversation's previous turn is anywhere now, and no regret yet."""
        self._last_replica.clear()
        self.regret_tokens.clear()
        self.session_moves.clear()
