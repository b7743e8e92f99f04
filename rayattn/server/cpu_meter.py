"""The cores this process used since the last reading: a router's load as its autoscaling
metric (rayattn/server/router_scaling.py). Process CPU counts every thread (the event loop,
the renderer's tokenizing threads), which is what a second router would take over."""

from __future__ import annotations

import time
from collections.abc import Callable


class CpuMeter:
    def __init__(self, cpu: Callable[[], float] = time.process_time,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._cpu, self._clock = cpu, clock
        self._last = (cpu(), clock())

    def read(self) -> float:
        """Cores used on average since the previous read (or since the meter was made)."""
        cpu, now = self._cpu(), self._clock()
        (cpu0, t0), self._last = self._last, (cpu, now)
        return (cpu - cpu0) / (now - t0) if now > t0 else 0.0
