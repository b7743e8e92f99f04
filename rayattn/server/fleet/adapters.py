"""One model's LoRA adapters, in one place: the path each name was loaded from (the routing
core hashes an adapter's blocks with it), which were loaded at run time (loaded again on
replicas that start later), and which engines answer to each."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from rayattn.routing.core import RoutingCore
from rayattn.server.background import detached
from rayattn.server.fleet.replica_set import Replica

log = logging.getLogger("rayattn.router")


class AdapterRegistry:
    def __init__(self, core: RoutingCore) -> None:
        # The core's own map is the registry's record of paths: it hashes with it.
        self._core = core
        self.runtime: dict[str, str] = {}
        """Loaded at run time through this router (name: path)."""
        self._loading: set[tuple[str, str]] = set()

    def knows(self, name: str | None) -> bool:
        return name is not None and name in self._core.adapter_paths

    def serves(self, r: Replica, name: str) -> bool:
        """Whether replica `r`'s engine answers to adapter `name` now."""
        return r.info is not None and name in r.info.adapters

    def probed(self, r: Replica) -> None:
        """What a probe of `r` says it serves; a replica that started after an adapter was
        loaded at run time gets it now."""
        assert r.info is not None
        self._core.adapter_paths.update(r.info.adapters)
        for name, path in self.runtime.items():
            if r.info.adapters.get(name) != path and (r.name, name) not in self._loading:
                self._loading.add((r.name, name))
                detached(self._load(r, name, path))

    def loaded(self, name: str, path: str, on: Iterable[Replica]) -> None:
        """`name` was loaded from `path` on the replicas `on`: routable there at once, not
        from their next probe on."""
        self.runtime[name] = self._core.adapter_paths[name] = path
        for r in on:
            if r.info is not None:
                r.info.adapters[name] = path

    def unloaded(self, name: str, on: Iterable[Replica]) -> None:
        self.runtime.pop(name, None)
        for r in on:
            if r.info is not None:
                r.info.adapters.pop(name, None)
        self._core.adapter_paths.pop(name, None)

    async def _load(self, r: Replica, name: str, path: str) -> None:
        try:
            reply = await r.handle.load_adapter.remote(name, path)
            if reply.status != 200:
                log.error("loading LoRA adapter %s on %s failed: %s", name, r.name,
                          reply.data[:300])
        except Exception as e:  # the next probe tries again
            log.warning("loading LoRA adapter %s on %s failed: %r", name, r.name, e)
        finally:
            self._loading.discard((r.name, name))
