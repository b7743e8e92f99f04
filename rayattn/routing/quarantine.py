"""Prompts that were being served when engines failed, refused once they have been there
too often.

An engine that crashes while running a request may have been crashed by it (a query of
death: a kernel fault on one shape, a tokenizer bug on one input). The dispatcher never
retries such a request, and counts here every prompt that was in flight when an engine
crashed, once per engine however many copies ran there; a prompt in flight at `after`
crashes is refused for `hold_s`, so a client that keeps resending it cannot take the
fleet's engines down one after another. Innocent prompts that shared an engine with a
poisonous one are counted once and are not refused. Prompts are told apart per tenant: one
key cannot get another's prompt refused, nor learn from a refusal that someone sent it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from rayattn.routing.policies import RouteRequest

CAPACITY = 4096
"""Prompts remembered at most (the oldest are forgotten first): bounded memory whatever
the failures."""


def fingerprint(route: RouteRequest, block_size: int, tenant: str = "") -> int:
    """The prompt's identity within `tenant`: the chained hash of its full blocks covers
    everything before its last partial block, which is hashed here."""
    tail = tuple(route.token_ids[len(route.keys) * block_size:])
    return hash((tenant, route.keys[-1] if route.keys else 0, tail))


class Quarantine:
    def __init__(self, after: int, hold_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.after, self.hold_s, self._clock = after, hold_s, clock
        self._seen: OrderedDict[int, tuple[frozenset[str], float]] = OrderedDict()
        """Fingerprint -> (the engines that crashed under it, when the last one did)."""

    def failed(self, prompt: int, engine: str) -> int:
        """`engine` crashed while running `prompt`: the engines it has crashed under now."""
        engines = self._engines(prompt) | {engine}
        self._seen[prompt] = (frozenset(engines), self._clock())
        self._seen.move_to_end(prompt)
        while len(self._seen) > CAPACITY:
            self._seen.popitem(last=False)
        return len(engines)

    def refused_for(self, prompt: int) -> float:
        """Seconds `prompt` stays refused (0: not refused)."""
        if not self.after or not self._seen:
            return 0.0
        engines, at = self._seen.get(prompt, (frozenset(), 0.0))
        if len(engines) < self.after:
            return 0.0
        return max(0.0, at + self.hold_s - self._clock())

    def _engines(self, prompt: int) -> frozenset[str]:
        engines, at = self._seen.get(prompt, (frozenset(), 0.0))
        # A quarantine served in full starts the count again.
        return engines if self._clock() < at + self.hold_s else frozenset()

    def __len__(self) -> int:
        return len(self._seen)
