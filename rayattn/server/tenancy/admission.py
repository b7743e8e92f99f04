"""What each tenant (API key) may hold of a router: admission by share and by weight, a
request rate, and its turn for an engine slot.

One key sending hundreds of requests must not starve another. Three places decide:
- `Admission`: the router's in-flight limit (`router.max_inflight`), counted in engine
  requests (a request with n=8 weighs 8); at the limit, a key still under its fair share of
  it (the limit over the keys present) is admitted, so a flood from one key never closes the
  door on the others.
- `RateLimits`: a token bucket per key (`router.key_requests_per_s`).
- `FairQueue`: when the engines are at this router's cap, or a key at its own
  (`router.key_max_inflight`), requests wait here, without polling, and each freed slot
  goes to the key with the fewest requests on the engines, in arrival order within a key.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import Counter

from rayattn.server.errors import APIError


class Admission:
    def __init__(self, limit: int) -> None:
        self.limit, self.inflight, self.peak = limit, 0, 0
        self.by_key: Counter[str] = Counter()

    def acquire(self, key: str = "", weight: int = 1) -> Slot:
        if self.inflight + weight > self.limit:
            keys = len(self.by_key) + (key not in self.by_key)
            # Never past twice the limit, however many keys arrive.
            if (self.by_key[key] + weight > self.limit / keys
                    or self.inflight + weight > 2 * self.limit):
                raise APIError(429, f"router at its admission limit ({self.limit} engine "
                                    "requests in flight, router.max_inflight); retry later",
                               retry_after=1)
        self.inflight += weight
        self.by_key[key] += weight
        self.peak = max(self.peak, self.inflight)
        return Slot(self, key, weight)


class Slot:
    """One admitted request's place; released exactly once, from whichever path ends the
    request first (response done, client gone, error before the response started)."""

    def __init__(self, admission: Admission, key: str = "", weight: int = 1) -> None:
        self._admission: Admission | None = admission
        self.key, self.weight = key, weight

    def release(self) -> None:
        a = self._admission
        if a is not None:
            a.inflight -= self.weight
            a.by_key[self.key] -= self.weight
            if a.by_key[self.key] <= 0:
                del a.by_key[self.key]
            self._admission = None


class RateLimits:
    """A token bucket per key: `rate` requests per second, bursts of up to a second's worth
    (at least one)."""

    def __init__(self, rate: float | None, clock=time.monotonic) -> None:
        self.rate, self._clock = rate, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)

    def take(self, key: str) -> None:
        if not self.rate:
            return
        burst = max(1.0, self.rate)
        now = self._clock()
        tokens, at = self._buckets.get(key, (burst, now))
        tokens = min(burst, tokens + (now - at) * self.rate)
        if tokens < 1:
            wait = (1 - tokens) / self.rate
            self._buckets[key] = (tokens, now)
            raise APIError(429, f"more than {self.rate:g} requests per second for this key "
                                "(router.key_requests_per_s)", retry_after=math.ceil(wait))
        self._buckets[key] = (tokens - 1, now)


RECHECK_S = 0.5
"""A waiting request looks again on its own this often (a freed slot it was not woken for:
one on a replica it had already tried, a live change of the caps)."""


class FairQueue:
    """Turns for engine slots. `dispatched` counts each key's requests on the engines (the
    dispatcher reports every attempt's start and end)."""

    def __init__(self, key_cap: int | None = None) -> None:
        self.key_cap = key_cap
        self.dispatched: Counter[str] = Counter()
        self._waiting: dict[int, tuple[str, asyncio.Future[None], bool]] = {}
        """Ticket -> (key, wake-up, whether it holds its place against newcomers)."""
        self._seq = itertools.count()

    def ticket(self) -> int:
        """A request's place in arrival order, kept across its waits."""
        return next(self._seq)

    def may_go(self, key: str, ticket: int) -> bool:
        """Whether `key`'s request may take an open slot now: its key is under its cap and
        no waiting request of another key ahead of it in the fair order."""
        if self.key_cap is not None and self.dispatched[key] >= self.key_cap:
            return False
        mine = (self.dispatched[key], ticket)
        return all(mine <= (self.dispatched[k], t) for t, (k, _, holds) in
                   self._waiting.items() if holds and t != ticket and self._eligible(k))

    async def wait(self, key: str, ticket: int, holds: bool = True) -> bool:
        """Until a slot is freed for this request (True) or the re-check interval passes.
        `holds`: whether newcomers must wait behind it. A retry does not hold: it may wait
        for a replica it has not tried yet while another replica sits free. A request that
        was woken and did not take the slot passes the turn on (`pass_turn`)."""
        wake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting[ticket] = (key, wake, holds)
        try:
            await asyncio.wait_for(asyncio.shield(wake), RECHECK_S)
            return True
        except TimeoutError:
            return False
        finally:
            self._waiting.pop(ticket, None)
            if wake.done() and asyncio.current_task().cancelling():
                self._wake_next()  # woken, then cancelled: the slot is someone else's

    def pass_turn(self) -> None:
        """A woken request could not use the freed slot: the next in line may."""
        self._wake_next()

    def wake_all(self) -> None:
        """Capacity changed (a replica joined, a cap was raised): everyone looks again."""
        for _, wake, _ in self._waiting.values():
            if not wake.done():
                wake.set_result(None)

    def started(self, key: str) -> None:
        self.dispatched[key] += 1

    def ended(self, key: str) -> None:
        self.dispatched[key] -= 1
        if self.dispatched[key] <= 0:
            del self.dispatched[key]
        self._wake_next()

    def _eligible(self, key: str) -> bool:
        return self.key_cap is None or self.dispatched[key] < self.key_cap

    def _wake_next(self) -> None:
        best = min(((self.dispatched[k], t, w) for t, (k, w, _) in self._waiting.items()
                    if self._eligible(k) and not w.done()), default=None,
                   key=lambda x: (x[0], x[1]))
        if best is not None:
            best[2].set_result(None)

    @property
    def waiting(self) -> int:
        return len(self._waiting)
