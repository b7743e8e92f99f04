"""The engine replica's own endpoint for the direct transport (router.engine_transport).

Serve's channel to a replica (its request router, a gRPC call, a replica task per request,
one message per chunk) costs each request milliseconds under load: on one H100 with 128
streams, 4–13 ms p50 to reach the engine replica and 2–3 ms back (docs/gpu.md section 8c),
where vllm-router's whole way to `vllm serve` costs about one. Here the router POSTs the
request straight to the replica's event loop, on a keep-alive connection, and reads the
answer as it streams (engine/wire.py).

Only routers reach it: the bearer token goes to them in the probe's reply, over the Ray
channel every request could already take. A request that arrives for another replica (a port
reused by a replacement) or while the replica drains is refused as never run, and the router
routes it again. A router that hangs up cancels the handler, which aborts the engine request
as Serve's cancellation does.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import socket
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from rayattn.engine import wire
from rayattn.engine.protocol import DirectAddress, EngineDown, OpenAIRequest, Reply

log = logging.getLogger("rayattn.engine")

Serve = Callable[[str | None, OpenAIRequest], AsyncIterator[Reply]]


class DirectServer:
    def __init__(self, serve: Serve, classify: Callable[[BaseException], wire.Raised]) -> None:
        """`serve`: the replica's own `serve(target, request)`; `classify`: how an exception
        it raises crosses the wire (wire.raised_of with the installed vLLM's classes)."""
        self._serve, self._classify = serve, classify
        self._token = secrets.token_urlsafe(32)
        self._runner: web.ServerRunner | None = None
        self.address: DirectAddress | None = None
        self.inflight = 0
        self.draining = False

    async def start(self, host: str) -> DirectAddress:
        # handler_cancellation: a router that hangs up cancels the handler, and with it the
        # engine request (aiohttp otherwise lets the handler run until it next writes).
        self._runner = web.ServerRunner(web.Server(self._handle, handler_cancellation=True),
                                        handle_signals=False, access_log=None)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.bind((host, 0))
        await web.SockSite(self._runner, sock).start()
        port = sock.getsockname()[1]
        self.address = DirectAddress(f"http://{_url_host(host)}:{port}", self._token)
        return self.address

    async def drain(self, timeout_s: float) -> None:
        """Refuse new calls (routers retry them elsewhere) and wait for those running: Serve
        drained only the calls it carried itself before it stops the replica."""
        self.draining = True
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.inflight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        given = request.headers.get(wire.AUTH_HEADER, "")
        if request.method != "POST" or not hmac.compare_digest(
                given.encode(), f"Bearer {self._token}".encode()):
            return web.Response(status=401)
        target = request.path.rsplit("/", 1)[-1] or None
        # The whole body, beyond the 1 MiB aiohttp's request.read() allows: only routers
        # that hold the token get here, and their bodies passed the router's own limits.
        try:
            req = wire.decode_request(await request.content.read())
        except Exception:
            return web.Response(status=400)
        resp = web.StreamResponse(headers={"content-type": "application/octet-stream"})
        await resp.prepare(request)
        self.inflight += 1
        try:
            if self.draining:
                raise EngineDown("engine replica is draining")
            async for item in self._serve(target, req):
                await resp.write(wire.reply_frame(item))
        except Exception as e:  # the engine's answer about this call: the router decides
            await resp.write(wire.raised_frame(self._classify(e)))
        finally:
            self.inflight -= 1
        await resp.write(wire.END_FRAME)
        await resp.write_eof()
        return resp


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
