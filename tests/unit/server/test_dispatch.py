"""Dispatcher.generate on fakes of its transport and candidates (no Ray): what one request's
attempts do to the routing core's load."""

from __future__ import annotations

import asyncio
import types
from collections.abc import AsyncGenerator

from rayattn.config.schema import RouterConfig
from rayattn.engine.protocol import OpenAIRequest, Reply
from rayattn.routing.core import RoutingCore
from rayattn.routing.policies import RouteRequest
from rayattn.routing.quarantine import Quarantine
from rayattn.server.dispatch import Dispatcher
from rayattn.server.tenancy.gates import Gates


class Engine:
    """A transport whose calls stream `n` chunks; records when a call's stream is closed."""

    def __init__(self) -> None:
        self.closed = 0

    async def call(self, replica: str, req: OpenAIRequest) -> AsyncGenerator[Reply, None]:
        try:
            for _ in range(3):
                yield Reply("data: {}\n\n")
                await asyncio.sleep(0)
        finally:
            self.closed += 1


def dispatcher() -> tuple[Dispatcher, Engine]:
    cfg = types.SimpleNamespace(router=RouterConfig(index="predicted"))
    d = Dispatcher.__new__(Dispatcher)
    d.cfg, d.metrics, d.counts = cfg, None, {"sent": 0, "succeeded": 0}
    d.core = RoutingCore(cfg.router.routing_settings(), 16)
    assert d.core.joined("a", 16, 100)
    d.gates, d.quarantine = Gates.of(cfg.router), Quarantine(1, 1)
    engine = Engine()
    d.transport = engine

    async def get(route, tried, wait_until, turn):
        return ["a"]
    d.candidates = types.SimpleNamespace(get=get, released=lambda: None)
    return d, engine


def test_a_caller_that_leaves_mid_stream_ends_the_engine_call_and_its_load_at_once():
    d, engine = dispatcher()

    async def go() -> None:
        gen = d.generate(OpenAIRequest("chat", {}, "r1"), RouteRequest([], 5, 0))
        await gen.__anext__()
        assert d.core.load.inflight["a"] == 1
        await gen.aclose()
        # Not left to the event loop's finalizer of an abandoned generator: the call is
        # closed and the load released by the time aclose returns.
        assert engine.closed == 1
        assert d.core.load.inflight["a"] == 0

    asyncio.run(go())
