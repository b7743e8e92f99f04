"""Load per replica: this router's own requests in flight there, exactly, plus the other
router replicas' requests as the engine last reported them.

Every engine replica counts its in-flight requests by the router that sent them (the
`origin` of each OpenAIRequest) and reports those counts with each probe and on the first
and final chunk of every request, stamped (pid, change counter) so that a router keeps the
newest report whatever order they arrive in. A router takes
its own share from its own bookkeeping, which is never stale, and only the others' share
from the report:

    inflight(r) = local(r) + Σ_{origin ≠ this router} reported(r, origin)

The engine's total alone would be up to one probe period old for this router's own requests
too: requests that finished while a report was on its way stay counted until the next one,
and in a closed loop, where every finished turn is followed at once by the next, that
phantom load fired the bounded-load guard and moved conversations off their cache.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping

ROUTER_MEMORY_S = 60.0
"""How long another router counts as sending to these engines after a report last showed
one of its requests."""


class LoadTracker:
    def __init__(self, origin: str = "", clock: Callable[[], float] = time.monotonic) -> None:
        self.origin = origin
        """This router's name in the engines' per-origin counts."""
        self.local: dict[str, int] = defaultdict(int)
        """Requests this router has in flight on each replica."""
        self.others: dict[str, int] = defaultdict(int)
        """Other routers' requests in flight on each replica, as its engine last reported."""
        self.pending_prefill: dict[str, int] = defaultdict(int)
        """Tokens dispatched to a replica whose first token has not come back yet."""
        self._stamps: dict[str, tuple[int, int]] = {}
        self._forgotten: set[str] = set()
        """Replicas that left while this router still had requests there."""
        self.device: dict[str, str] = {}
        """The device each replica computes on. Replicas on one device (two engines on one
        GPU) share its throughput: work moved between them frees nothing, so their load
        is counted together (`device_load`)."""
        self.batch: dict[str, int] = {}
        """How many requests each replica's engine runs in one batch (vLLM's max_num_seqs):
        below that a new request joins the running batch instead of queueing."""
        self.inflight = _Inflight(self)
        self._clock = clock
        self._senders: dict[str, float] = {}
        """Other routers seen with requests in the engines' reports, and when last."""

    def reported(self, replica: str, by_origin: Mapping[str, int],
                 stamp: tuple[int, int] | None = None) -> None:
        """An engine's count of its in-flight requests per sending router; a report older
        than one already applied (same engine process, lower counter) is dropped."""
        last = self._stamps.get(replica)
        if stamp is not None:
            if last is not None and last[0] == stamp[0] and stamp[1] < last[1]:
                return
            self._stamps[replica] = stamp
        self.others[replica] = sum(n for o, n in by_origin.items() if o != self.origin)
        now = None
        for o, n in by_origin.items():
            if n and o and o != self.origin:  # "": a request no router sent
                self._senders[o] = now = now or self._clock()

    def routers(self) -> int:
        """Router replicas sending requests to these engines, this one included: the other
        origins the engines reported requests of within ROUTER_MEMORY_S."""
        cutoff = self._clock() - ROUTER_MEMORY_S
        for o in [o for o, t in self._senders.items() if t < cutoff]:
            del self._senders[o]
        return 1 + len(self._senders)

    def acquire(self, replica: str, prefill_tokens: int) -> None:
        """One request of this router sent to `replica`, `prefill_tokens` of it uncached;
        released exactly once by `release`, however the call ends."""
        self._forgotten.discard(replica)  # back (a transient down) or never gone
        self.local[replica] += 1
        self.pending_prefill[replica] += prefill_tokens

    def prefill_done(self, replica: str, prefill_tokens: int) -> None:
        self.pending_prefill[replica] = max(0, self.pending_prefill[replica] - prefill_tokens)

    def release(self, replica: str, prefill_tokens_left: int = 0) -> None:
        self.local[replica] = max(0, self.local[replica] - 1)
        self.prefill_done(replica, prefill_tokens_left)
        if replica in self._forgotten and self.local[replica] == 0:
            self._drop(replica)

    def _drop(self, replica: str) -> None:
        # Replicas come and go under autoscaling: keep no entry for one that left.
        self.local.pop(replica, None)
        self.pending_prefill.pop(replica, None)
        self._forgotten.discard(replica)

    def forget(self, replica: str) -> None:
        """A replica left the set. Only the other routers' report goes: this router's own
        counts drop as its calls to the replica end (each releases exactly once), and a
        replica marked down on a transient error that rejoins at the next probe must not
        have its still-running requests forgotten."""
        self.others.pop(replica, None)
        self._stamps.pop(replica, None)
        self.device.pop(replica, None)
        self.batch.pop(replica, None)
        self._forgotten.add(replica)
        if self.local.get(replica, 0) == 0:
            self._drop(replica)

    def device_load(self) -> dict[str, tuple[int, int]]:
        """(pending prefill tokens, in-flight requests) per replica, each summed over the
        replicas on its device (one pass, once per routing decision)."""
        per_device: dict[str, tuple[int, int]] = {}
        for r, d in self.device.items():
            p, n = per_device.get(d, (0, 0))
            per_device[d] = (p + self.pending_prefill.get(r, 0), n + self.inflight[r])
        names = set(self.local) | set(self.others) | set(self.device)
        return {r: per_device[self.device[r]] if r in self.device
                else (self.pending_prefill.get(r, 0), self.inflight[r]) for r in names}

    def imbalance(self, replicas: list[str]) -> float:
        """max / mean in-flight (1.0 = perfectly even; 0 when idle)."""
        loads = [self.inflight[r] for r in replicas]
        mean = sum(loads) / len(loads) if loads else 0
        return max(loads) / mean if mean else 0.0


class _Inflight:
    """`load.inflight[r]`: the fleet-wide in-flight estimate (read-only mapping)."""

    def __init__(self, t: LoadTracker) -> None:
        self._t = t

    def __getitem__(self, replica: str) -> int:
        return self._t.local.get(replica, 0) + self._t.others.get(replica, 0)

    def get(self, replica: str, default: int = 0) -> int:
        return self[replica]

    def items(self) -> list[tuple[str, int]]:
        names = set(self._t.local) | set(self._t.others)
        return [(r, self[r]) for r in names]
