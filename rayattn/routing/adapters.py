"""Which LoRA adapters each engine replica holds and runs, as this router has seen it.

An engine loads the configured adapters in order at start-up (vLLM's static LoRA modules)
and keeps up to `max_cpu_loras` of them, least recently used going first: the last ones
loaded stay. A request for one it dropped loads it again. One batch runs at most `max_loras`
distinct adapters, and a request for another one waits for a slot. The engines publish
neither, but the router knows the start-up order and sent every request that made them
load: it replays vLLM's LRU over both, and counts the adapters in flight per replica.
"""

from __future__ import annotations

from collections import Counter, OrderedDict


class AdapterResidency:
    def __init__(self, slots: int = 0, cached: int = 0) -> None:
        """`slots`: vLLM's max_loras; `cached`: adapters an engine keeps loaded
        (max_cpu_loras). 0: the engines serve no adapters."""
        self.slots, self.cached = slots, cached
        self._loaded: dict[str, OrderedDict[str, None]] = {}
        self._running: dict[str, Counter[str]] = {}

    def holds(self, replica: str, adapter: str) -> bool:
        """Whether `adapter` is loaded in `replica`'s engine (a request there loads none)."""
        return adapter in self._loaded.get(replica, ())

    def waits_for_slot(self, replica: str, adapter: str) -> bool:
        """Whether a request for `adapter` on `replica` would wait for another adapter's
        requests to finish: every batch slot runs a different adapter."""
        running = self._running.get(replica)
        if not running or adapter in running:
            return False
        return len(running) >= self.slots

    def joined(self, replica: str, preloaded: list[str]) -> None:
        """A (re)started replica: what its engine loaded at start-up, in that order."""
        self.forget(replica)
        if self.cached:
            self._loaded[replica] = OrderedDict.fromkeys(preloaded[-self.cached:])

    def dispatched(self, replica: str, adapter: str | None) -> None:
        if adapter is None or not self.cached:
            return
        loaded = self._loaded.setdefault(replica, OrderedDict())
        loaded[adapter] = None
        loaded.move_to_end(adapter)
        while len(loaded) > self.cached:
            loaded.popitem(last=False)
        self._running.setdefault(replica, Counter())[adapter] += 1

    def ended(self, replica: str, adapter: str | None) -> None:
        running = self._running.get(replica)
        if adapter is None or running is None or not running[adapter]:
            return
        running[adapter] -= 1
        if not running[adapter]:
            del running[adapter]

    def forget(self, replica: str) -> None:
        """A replica left (or restarted): its engine holds nothing."""
        self._loaded.pop(replica, None)
        self._running.pop(replica, None)
