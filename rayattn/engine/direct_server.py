"""The engine replica's own endpoint for the direct transport (router.engine_transport).

Serve's channel to a replica (its request router, a gRPC call, a replica task per request,
one message per chunk) adds several Ray hops and a task per request to each request's way to
the engine and per chunk on its way back, which grows with the streams in flight; a plain
HTTP stream to the replica, as vllm-router's to `vllm serve`, has none of them (the figures:
docs/results.md, "The way to the first token"). Here the router POSTs the request straight to the
replica's event loop, on a keep-alive connection, and reads the answer as it streams
(engine/wire.py).

Only routers reach it: the bearer token goes to them in the probe's reply, over the Ray
channel every request could already take. A request that arrives for another replica (a port
reused by a replacement) or while the replica drains is refused as never run, and the router
routes it again. A router that hangs up cancels the handler, which aborts the engine request
as Serve's cancellation does.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import socket
from collections.abc import AsyncGenerator, Callable

import msgspec
from aiohttp import web

from rayattn.engine import wire
from rayattn.engine.protocol import DirectAddress, EngineDown, OpenAIRequest, Reply

log = logging.getLogger("rayattn.engine")

ServeCall = Callable[[str | None, OpenAIRequest], AsyncGenerator[Reply, None]]


class DirectServer:
    def __init__(self, serve: ServeCall,
                 classify: Callable[[BaseException], wire.Raised]) -> None:
        """`serve`: the replica's own `serve(target, request)`; `classify`: how an exception
        it raises crosses the wire (wire.raised_of with the installed vLLM's classes)."""
        self._serve, self._classify = serve, classify
        self._token = f"Bearer {secrets.token_urlsafe(32)}".encode()
        self._runner: web.ServerRunner | None = None
        self._started: asyncio.Task[DirectAddress | None] | None = None
        self.inflight = 0
        """Calls running now (drained at shutdown)."""
        self.draining = False

    async def address(self, host: str) -> DirectAddress | None:
        """The endpoint, started on the first call however many probes ask at once (None:
        it could not start; routers keep to Serve's channel)."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._start(host))
        return await asyncio.shield(self._started)

    async def _start(self, host: str) -> DirectAddress | None:
        # handler_cancellation: a router that hangs up cancels the handler, and with it the
        # engine request (aiohttp otherwise lets the handler run until it next writes).
        server = web.Server(self._handle, handler_cancellation=True, access_log=None)
        # At shutdown drain() has waited for the calls: what is left to close is idle.
        runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=1.0)
        sock: socket.socket | None = None
        try:
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            sock.bind((host, 0))
            await runner.setup()
            await web.SockSite(runner, sock).start()
        except Exception as e:
            if sock is not None:
                sock.close()
            await runner.cleanup()
            log.warning("direct endpoint not started (routers use Serve's channel): %s", e)
            return None
        self._runner = runner
        token = self._token.decode().removeprefix("Bearer ")
        return DirectAddress(f"http://{_url_host(host)}:{sock.getsockname()[1]}", token)

    async def drain(self, timeout_s: float) -> None:
        """Refuse new calls (routers retry them elsewhere) and wait up to `timeout_s` for
        those running: Serve drained only the calls it carried itself before it stops the
        replica."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.inflight and loop.time() < deadline:
            await asyncio.sleep(0.1)
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        given = request.headers.get(wire.AUTH_HEADER, "").encode("utf-8", "surrogateescape")
        if request.method != "POST" or not hmac.compare_digest(given, self._token):
            return web.Response(status=401)
        target = request.path.rsplit("/", 1)[-1] or None
        # The whole body, beyond the 1 MiB aiohttp's request.read() allows: only routers
        # that hold the token get here, and their bodies passed the router's own limits.
        try:
            req = wire.decode_request(await request.content.read())
        except (msgspec.DecodeError, msgspec.ValidationError):
            return web.Response(status=400)
        resp = web.StreamResponse(headers={"content-type": "application/octet-stream"})
        await resp.prepare(request)
        frames = self._frames(target, req)
        # aclosing: a write that fails (the router hung up) ends the engine request now,
        # not when the generator is collected.
        async with contextlib.aclosing(frames):
            async for frame in frames:
                await resp.write(frame)
        await resp.write_eof()
        return resp

    async def _frames(self, target: str | None, req: OpenAIRequest
                      ) -> AsyncGenerator[bytes, None]:
        """The answer's frames: each reply, the engine's exception if it raised one, the
        end. Only the engine's exceptions become frames, never the router's hang-up."""
        self.inflight += 1
        try:
            if self.draining:
                yield wire.raised_frame(self._classify(
                    EngineDown("engine replica is draining")))
            else:
                replies = self._serve(target, req)
                async with contextlib.aclosing(replies):
                    try:
                        async for item in replies:
                            yield wire.reply_frame(item)
                    except Exception as e:  # the engine's answer: the router decides
                        yield wire.raised_frame(self._classify(e))
            yield wire.END_FRAME
        finally:
            self.inflight -= 1


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
