"""An engine's requests in flight, counted per sending router (origin) and per DP rank the
router pinned them to: every probe reply and each request's first and final chunk carry
them, so a router knows what other routers sent the same engine."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class InflightCounts:
    def __init__(self) -> None:
        self._by: Counter[tuple[int | None, str]] = Counter()
        """Requests in flight by (DP rank the router pinned them to, or None; origin)."""
        # Bumped on every change of the counts: reports taken at different moments (a probe
        # reply, chunks of concurrent requests) reach a router in any order, and it keeps
        # only the newest (routing/load.py).
        self._seq = 0

    @contextmanager
    def counting(self, rank: int | None, origin: str) -> Iterator[None]:
        """One request of `origin` pinned to `rank`, counted while the block runs."""
        key = (rank, origin)
        self._by[key] += 1
        self._seq += 1
        try:
            yield
        finally:
            self._by[key] -= 1
            self._seq += 1
            if self._by[key] <= 0:
                del self._by[key]

    def of(self, rank: int | None) -> dict[str, int]:
        """In-flight requests per sending router: those pinned to DP rank `rank`, or (None)
        all of the engine's."""
        out: Counter[str] = Counter()
        for (r, origin), n in self._by.items():
            if rank is None or r == rank:
                out[origin] += n
        return dict(out)

    def report(self, rank: int | None = None) -> dict[str, Any]:
        """In-flight requests per sending router (of DP rank `rank`, else of the engine),
        stamped (pid, change counter)."""
        return {"inflight_by_origin": self.of(rank), "inflight_stamp": (os.getpid(), self._seq)}
