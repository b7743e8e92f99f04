"""Which blocks one engine's KV cache and host tier hold, as its vLLM KV events say: the
view a KV mirror (engine/kv_mirror.py) keeps and snapshots. Not thread-safe: the mirror
calls it under its lock."""

from __future__ import annotations

from collections import Counter

from rayattn.routing.kv_events import Snapshot, Tier


class MirroredBlocks:
    """A `CacheSink` (routing/kv_events.py) that remembers which batch cleared it last."""

    def __init__(self) -> None:
        self._keys: dict[int, None] = {}
        self._offloaded: Counter[int] = Counter()
        """Host-tier blocks, counted: vLLM may announce one block in several chunks."""
        self.applying = -1
        """The sequence number of the batch being applied (set by the mirror)."""
        self.vllm_cleared = -1
        """The last batch that carried vLLM's own AllBlocksCleared."""

    def stored(self, keys: list[int], tier: Tier) -> None:
        if tier == "gpu":
            self._keys.update(dict.fromkeys(keys))
        else:
            self._offloaded.update(keys)

    def removed(self, keys: list[int], tier: Tier) -> None:
        if tier == "gpu":
            for k in keys:
                self._keys.pop(k, None)
            return
        for k in keys:
            if self._offloaded[k] <= 1:
                self._offloaded.pop(k, None)
            else:
                self._offloaded[k] -= 1

    def cleared(self) -> None:
        self.forget()
        self.vllm_cleared = self.applying

    def forget(self) -> None:
        """Empty, as after the engine's own reset (which vLLM may announce much later)."""
        self._keys.clear()
        self._offloaded.clear()

    def snapshot(self, seq: int) -> Snapshot:
        return Snapshot(seq, list(self._keys), list(self._offloaded.elements()))

    @property
    def offloaded_blocks(self) -> int:
        return len(self._offloaded)

    def __len__(self) -> int:
        return len(self._keys)
