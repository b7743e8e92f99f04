"""The base models one router serves, each with its engines (a ModelRoute), and which of
them a request's `model` names."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

from rayattn.server.dispatch import Dispatcher
from rayattn.server.model_route import ModelRoute


class Bases:
    def __init__(self, routes: list[ModelRoute]) -> None:
        self.routes = {r.name: r for r in routes}
        """In the config's order: the first answers requests that name no model, as
        `vllm serve` answers them with its first served name."""
        self._by_model = {n: r for r in routes for n in r.cfg.model.served_names}

    def __iter__(self) -> Iterator[ModelRoute]:
        return iter(self.routes.values())

    def __len__(self) -> int:
        return len(self.routes)

    @property
    def first(self) -> ModelRoute:
        return next(iter(self.routes.values()))

    @property
    def dispatchers(self) -> list[Dispatcher]:
        return [r.dispatcher for r in self.routes.values()]

    def named(self, model: str) -> ModelRoute | None:
        """The base model a `model` names: itself, a configured adapter of it, or one
        loaded at run time."""
        return self._by_model.get(model) or next(
            (r for r in self.routes.values() if r.adapter(model) is not None), None)

    async def start(self) -> None:
        """Every model's fleet view and renderer started (each route starts them once):
        called on every route's way in, so whichever call comes first starts them."""
        if slow := os.environ.get("RAYATTN_SLOW_CALLBACK_S"):
            # Diagnosis (bench/gpu/profile_router.sh): asyncio logs every step that holds
            # this loop longer than this, i.e. what delays every other request.
            loop = asyncio.get_running_loop()
            if not loop.get_debug():
                loop.set_debug(True)
                loop.slow_callback_duration = float(slow)
        for route in self.routes.values():
            await route.start()

    async def synced(self) -> None:
        """Return once every engine's KV event view has its first snapshot, or after
        kv_feeds.SYNC_GRACE_S; from then on the router takes traffic whatever its feeds do
        (Serve calls this through reconfigure before the first request)."""
        for d in self.dispatchers:
            d.feeds.hold()
        while any(d.feeds.syncing() for d in self.dispatchers):
            await asyncio.sleep(0.05)
        for d in self.dispatchers:
            d.feeds.release()
