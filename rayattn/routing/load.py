"""Load per replica: the engine's own count of unfinished requests (running + waiting, as
every router replica sees it), plus what this router sent since that count was taken.

The engine's count alone is up to one probe period stale and would read zero on a fresh
replica while a burst lands on it; this router's own dispatches alone miss what the other
router replicas sent. Their combination is fleet-wide and current:

    inflight(r) = max(local(r), engine_count(r) - done_since(r) + sent_since(r))

where sent_since counts this router's requests sent after the count was taken and still in
flight, and done_since those of its requests that the count included and that have finished
since (without it, a replica finishing requests between two counts looks busier than it is
and the load guard moves conversations off their cache).
"""

from __future__ import annotations

from collections import defaultdict


class LoadTracker:
    def __init__(self) -> None:
        self.local: dict[str, int] = defaultdict(int)
        """Requests this router has in flight on each replica."""
        self.engine: dict[str, int] = defaultdict(int)
        """Unfinished requests the engine last reported."""
        self.sent_since: dict[str, int] = defaultdict(int)
        """Requests sent since the engine's last report and still in flight."""
        self.done_since: dict[str, int] = defaultdict(int)
        """Requests in the engine's last count that this router has seen finish since."""
        self.epoch: dict[str, int] = defaultdict(int)
        """Reports received per replica: tells whether a request predates the last one."""
        self.pending_prefill: dict[str, int] = defaultdict(int)
        """Tokens dispatched to a replica whose first token has not come back yet."""
        self.inflight = _Inflight(self)

    def reported(self, replica: str, unfinished: int) -> None:
        self.engine[replica] = unfinished
        self.sent_since[replica] = 0
        self.done_since[replica] = 0
        self.epoch[replica] += 1

    def acquire(self, replica: str, prefill_tokens: int) -> int:
        """Count a request sent to `replica`; returns the token to pass to `release`."""
        self.local[replica] += 1
        self.sent_since[replica] += 1
        self.pending_prefill[replica] += prefill_tokens
        return self.epoch[replica]

    def prefill_done(self, replica: str, prefill_tokens: int) -> None:
        self.pending_prefill[replica] = max(0, self.pending_prefill[replica] - prefill_tokens)

    def release(self, replica: str, prefill_tokens_left: int = 0,
                epoch: int | None = None) -> None:
        self.local[replica] = max(0, self.local[replica] - 1)
        self.prefill_done(replica, prefill_tokens_left)
        if epoch is None or epoch == self.epoch[replica]:
            # Sent after the engine's last count, so not in it: no longer in flight.
            self.sent_since[replica] = max(0, self.sent_since[replica] - 1)
        else:
            # In the engine's last count, which now overstates the load by one.
            self.done_since[replica] += 1

    def forget(self, replica: str) -> None:
        for d in (self.local, self.engine, self.sent_since, self.done_since,
                  self.pending_prefill):
            d.pop(replica, None)

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
        t = self._t
        return max(t.local.get(replica, 0),
                   t.engine.get(replica, 0) - t.done_since.get(replica, 0)
                   + t.sent_since.get(replica, 0))

    def get(self, replica: str, default: int = 0) -> int:
        return self[replica]

    def items(self):
        names = set(self._t.local) | set(self._t.engine)
        return [(r, self[r]) for r in names]
