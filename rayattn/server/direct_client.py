"""The router's end of the direct transport (router.engine_transport: direct): one keep-alive
connection pool per router process, a POST per call to the chosen replica's own endpoint
(engine/direct_server.py), the answer read frame by frame as it streams (engine/wire.py).

Errors come out as the Serve channel's do, so the retry loop (server/dispatch.py) reads
both alike (server/replica_set.py `failure`): the engine's own exception by its kind
(`wire.EngineRaised`), a replica that cannot be reached or whose answer is cut
(`aiohttp.ClientConnectionError`, `aiohttp.ClientPayloadError`, `wire.StreamCut`) as a
replica gone."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp

from rayattn.engine import wire
from rayattn.engine.protocol import DirectAddress, Reply


class DirectClient:
    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No pool limit: the router's own admission bounds the calls in flight, and a
            # call held here for a connection would be a queue nobody sees. No timeout: the
            # router's request_timeout_s bounds the request as a whole.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=False),
                timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
        return self._session

    async def stream(self, address: DirectAddress, replica: str,
                     body: bytes) -> AsyncIterator[Reply]:
        """The replies to one call (`body`: wire.encode_request's), ended or cut as the
        engine's answer is; closing the generator hangs up, which aborts the call there."""
        async with self._open().post(
                f"{address.url}/serve/{replica}", data=body,
                headers={wire.AUTH_HEADER: f"Bearer {address.token}",
                         "content-type": "application/octet-stream"}) as resp:
            if resp.status != 200:
                # 401: the address is another process's now (a replacement took the port),
                # so the call never ran; anything else is the router's own bug.
                raise wire.EngineRaised(wire.Raised(
                    "never_ran" if resp.status == 401 else "request",
                    f"HTTP {resp.status}", f"direct endpoint of {replica} answered "
                    f"{resp.status}", client_error=False))
            async for item in wire.replies(resp.content):
                yield item
            # To the chunked body's end, so the connection goes back to the pool (one
            # released unread is closed).
            await resp.content.read()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
