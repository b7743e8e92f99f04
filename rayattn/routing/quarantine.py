"""Prompts that were being served when engines failed, refused once they have been there
too often.

An engine that crashes while running a request may have been crashed by it (a query of
death: a kernel fault on one shape, a tokenizer bug on one input). The dispatcher never
retries such a request, and counts here every prompt that was in flight at an engine
failure; a prompt counted `after` times is refused for `hold_s`, so a client that keeps
resending it cannot take the fleet's engines down one after another. Innocent requests
that shared an engine with a poisonous one are counted once each and are not refused.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from rayattn.routing.policies import RouteRequest

CAPACITY = 4096
"""Prompts remembered at most (the oldest are forgotten first): bounded memory whatever
the failures."""


def fingerprint(route: RouteRequest, block_size: int) -> int:
    """The prompt's identity: the chained hash of its full blocks covers everything before
    its last partial block, which is hashed here."""
    tail = tuple(route.token_ids[len(route.keys) * block_size:])
    return hash((route.keys[-1] if route.keys else 0, tail))


class Quarantine:
    def __init__(self, after: int, hold_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.after, self.hold_s, self._clock = after, hold_s, clock
        self._seen: OrderedDict[int, tuple[int, float]] = OrderedDict()
        """Fingerprint -> (failures it was in flight at, when the last one was)."""

    def failed(self, prompt: int) -> int:
        """An engine failed while serving `prompt`: its count now."""
        count = self._count(prompt) + 1
        self._seen[prompt] = (count, self._clock())
        self._seen.move_to_end(prompt)
        while len(self._seen) > CAPACITY:
            self._seen.popitem(last=False)
        return count

    def refused_for(self, prompt: int) -> float:
        """Seconds `prompt` stays refused (0: not refused)."""
        if not self.after or not self._seen:
            return 0.0
        count, at = self._seen.get(prompt, (0, 0.0))
        if count < self.after:
            return 0.0
        return max(0.0, at + self.hold_s - self._clock())

    def _count(self, prompt: int) -> int:
        count, at = self._seen.get(prompt, (0, 0.0))
        # A quarantine served in full starts the count again.
        return count if self._clock() < at + self.hold_s else 0

    def __len__(self) -> int:
        return len(self._seen)
