"""In-flight work per replica, tracked by the router itself at dispatch and release.

Never scraped: a scraped queue length is seconds stale and reads zero on a fresh replica,
which is how other routers ended up sending everything to one worker.
"""

from __future__ import annotations

from collections import defaultdict


class LoadTracker:
    def __init__(self) -> None:
        self.inflight: dict[str, int] = defaultdict(int)
        self.pending_prefill: dict[str, int] = defaultdict(int)
        """Tokens dispatched to a replica whose first token has not come back yet."""

    def acquire(self, replica: str, prefill_tokens: int) -> None:
        self.inflight[replica] += 1
        self.pending_prefill[replica] += prefill_tokens

    def prefill_done(self, replica: str, prefill_tokens: int) -> None:
        self.pending_prefill[replica] = max(0, self.pending_prefill[replica] - prefill_tokens)

    def release(self, replica: str, prefill_tokens_left: int = 0) -> None:
        self.inflight[replica] = max(0, self.inflight[replica] - 1)
        self.prefill_done(replica, prefill_tokens_left)

    def forget(self, replica: str) -> None:
        self.inflight.pop(replica, None)
        self.pending_prefill.pop(replica, None)

    def imbalance(self, replicas: list[str]) -> float:
        """max / mean in-flight (1.0 = perfectly even; 0 when idle)."""
        loads = [self.inflight[r] for r in replicas]
        mean = sum(loads) / len(loads) if loads else 0
        return max(loads) / mean if mean else 0.0
