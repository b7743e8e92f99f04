"""How one call reaches one engine replica: its direct endpoint where the router chose that
transport and the replica offers one, else Serve's channel aimed at the replica
(server/fleet/pinning.py). Either way, closing the call's generator hangs up."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

import aiohttp

from rayattn.engine import wire
from rayattn.engine.protocol import EngineInfo, OpenAIRequest, Reply
from rayattn.server.fleet.pinning import PinnedHandle
from rayattn.server.forwarding.direct_client import DirectClient

log = logging.getLogger("rayattn.router")

UNREACHABLE_S = 60.0
"""How long a replica whose direct endpoint could not be used gets Serve's channel."""


class EngineTransport:
    def __init__(self, engines: Any, info: Callable[[str], EngineInfo | None],
                 transport: Callable[[], str], counts: dict[str, float],
                 autoscaled: Callable[[], bool]) -> None:
        """`engines`: the engine deployment's handle; `info(replica)`: what its last probe
        said; `transport()`: router.engine_transport now (a live setting); `counts`: the
        router's, where direct calls are counted; `autoscaled()`: whether Serve autoscales
        the engine deployment now (server/fleet/autoscaling.py)."""
        self._engines = engines
        self._info, self._transport, self._autoscaled = info, transport, autoscaled
        self._counts = counts
        self._direct = DirectClient()
        self._streaming: tuple[str, Any] | None = None  # (transport, streaming handle)
        self._unreachable: dict[str, tuple[str, float]] = {}
        """Replicas whose direct endpoint could not be used: (the address tried, until)."""

    def forget(self, replica: str) -> None:
        self._unreachable.pop(replica, None)

    async def call(self, replica: str, req: OpenAIRequest) -> AsyncGenerator[Reply, None]:
        """One call's replies, over the direct transport where it is chosen and the replica
        offers it, else over Serve's channel."""
        # An autoscaled deployment keeps to Serve's channel: Serve's autoscaler counts only
        # the calls it carries, and would never see this load.
        if self._transport() == "direct" and not self._autoscaled():
            info = self._info(replica)
            address = info.direct if info is not None else None
            body = wire.encode_request(req) if address is not None else None
            shunned = self._unreachable.get(replica)
            if address is not None and body is not None and not (
                    shunned and shunned[0] == address.url and time.monotonic() < shunned[1]):
                try:
                    async with contextlib.aclosing(
                            self._direct.stream(address, replica, body)) as replies:
                        self._counts["direct_calls"] += 1
                        async for item in replies:
                            yield item
                    return
                except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError,
                        wire.EndpointUnusable) as e:
                    # Nothing ran. Where the process is gone, Serve's channel says so next;
                    # where only its port is out of reach (a firewall between nodes) or
                    # something else answers there, that replica's calls keep to Serve's
                    # channel for a while.
                    self._unreachable[replica] = (address.url,
                                                  time.monotonic() + UNREACHABLE_S)
                    log.warning("direct endpoint of %s unusable (%s): calls to it go over "
                                "Serve's channel for %.0f s", replica, e, UNREACHABLE_S)
        gen = self._stream_handle(replica).serve.remote(req)
        try:
            async for item in gen:
                yield item
        finally:
            gen.cancel()

    def _stream_handle(self, replica: str) -> PinnedHandle:
        """The engine deployment's streaming handle, aimed at `replica`; built once per
        transport (a live setting) rather than by Serve's `options()` on every request."""
        transport = self._transport()
        if self._streaming is None or self._streaming[0] != transport:
            if transport in ("grpc", "direct"):  # direct: for calls it cannot carry
                # Items are plain dataclasses of this package: the standard pickle is enough.
                handle = self._engines.options(stream=True, _by_reference=False,
                                               request_serialization="pickle",
                                               response_serialization="pickle")
            else:
                handle = self._engines.options(stream=True)
            self._streaming = (transport, handle)
        return PinnedHandle(self._streaming[1], replica)
