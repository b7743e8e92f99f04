"""How long this process's event loop and garbage collector stop everything else.

A request that reaches the router while its loop is held (a long callback, a full garbage
collection of a large index) waits before its handler runs, which no per-request timer of
the router sees. /health reports the longest stalls since start, so a benchmark can tell
a router that stalls from a slow HTTP proxy or client (bench/gpu/routing.py keeps them)."""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

TICK_S = 0.02


class LoopWatch:
    def __init__(self, slow_s: float = 0.1) -> None:
        self.slow_s = slow_s
        self.lag_max_s = 0.0
        self.lag_slow = 0
        """Ticks that came `slow_s` or more late."""
        self.gc_max_s = 0.0
        self.gc_slow = 0
        self._gc_start: float | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            gc.callbacks.append(self._gc)
            self._task = asyncio.get_running_loop().create_task(self._tick())

    def stop(self) -> None:
        if self._task is not None:
            gc.callbacks.remove(self._gc)
            self._task.cancel()
            self._task = None

    def _gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            took = time.perf_counter() - self._gc_start
            self._gc_start = None
            self.gc_max_s = max(self.gc_max_s, took)
            self.gc_slow += took >= self.slow_s

    async def _tick(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(TICK_S)
            late = time.perf_counter() - t - TICK_S
            self.lag_max_s = max(self.lag_max_s, late)
            self.lag_slow += late >= self.slow_s

    def counts(self) -> dict[str, float]:
        return {"loop_lag_max_ms": round(self.lag_max_s * 1e3, 1), "loop_lag_slow": self.lag_slow,
                "gc_max_ms": round(self.gc_max_s * 1e3, 1), "gc_slow": self.gc_slow}
