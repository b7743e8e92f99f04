"""The router's end of the direct transport (router.engine_transport: direct): a keep-alive
connection pool per dispatcher (one per model a router routes), a POST per call to the
chosen replica's own endpoint (engine/direct_server.py), the answer read frame by frame as
it streams (engine/wire.py).

Errors come out as the Serve channel's do, so the retry loop (server/dispatch.py) reads
both alike (server/fleet/replica_set.py `failure`): the engine's own exception by its kind
(`wire.EngineRaised`), a replica that cannot be reached or whose answer is cut
(`aiohttp.ClientConnectionError`, `aiohttp.ClientPayloadError`, `wire.StreamCut`) as a
replica gone."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import aiohttp

from rayattn.engine import wire
from rayattn.engine.protocol import DirectAddress, Reply

CONNECT_TIMEOUT_S = 5.0


class DirectClient:
    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No pool limit: the router's own admission bounds the calls in flight, and a
            # call held here for a connection would be a queue nobody sees. No timeout: the
            # router's request_timeout_s bounds the request as a whole.
            # A replica unreachable on its port (a firewall) fails fast and the call goes
            # over Serve's channel (server/dispatch.py).
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=False),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S),
                auto_decompress=False)
        return self._session

    async def stream(self, address: DirectAddress, replica: str,
                     body: bytes) -> AsyncGenerator[Reply, None]:
        """The replies to one call (`body`: wire.encode_request's), ended or cut as the
        engine's answer is; closing the generator hangs up, which aborts the call there."""
        async with self._open().post(
                f"{address.url}/serve/{replica}", data=body,
                headers={wire.AUTH_HEADER: f"Bearer {address.token}",
                         "content-type": "application/octet-stream"}) as resp:
            if resp.status == 401:
                # A stale token: another replica's process took the port. Nothing ran.
                raise wire.EngineRaised(wire.Raised(
                    "never_ran", "HTTP 401", f"direct endpoint of {replica} answered 401",
                    client_error=False))
            if resp.status != 200:
                raise wire.EndpointUnusable(f"direct endpoint of {replica} answered "
                                            f"{resp.status}")
            async for item in wire.replies(resp.content):
                yield item

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
