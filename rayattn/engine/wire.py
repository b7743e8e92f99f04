"""The direct transport's wire format (router.engine_transport: direct), both ends of it.

A call is one HTTP POST from the router to the engine replica's own endpoint
(engine/direct_server.py) with the OpenAIRequest as msgpack; the answer streams back as
frames: one byte of kind, four of length, then msgpack. A `Reply` frame per item, a
`Raised` frame where the engine raised, and an end frame: a stream cut before its end frame
means the replica went away mid-call. msgpack keeps token ids and floats exact and costs
microseconds, where the rest of the call is what the transport exists to save.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import msgspec

from rayattn.engine.protocol import OpenAIRequest, Reply

_HEADER = struct.Struct("!cI")
_REPLY, _RAISED, _END = b"R", b"E", b"Z"

AUTH_HEADER = "authorization"

RaisedKind = Literal["request", "never_ran", "engine_crashed"]
"""What an exception the engine raised says, as the router's retry loop reads it (these are
three of server/fleet/replica_set.py's `Failure`s; a replica that died is told by the connection,
not a frame)."""


@dataclass
class Raised:
    """An exception the engine replica raised, as it crosses the wire."""

    failure: RaisedKind
    type: str
    message: str
    client_error: bool
    """vLLM's validation of the request (the client's 400, compat.client_error_types)."""
    parameter: str | None = None
    """The request field vLLM's error names, where it names one."""


class EngineRaised(Exception):
    """A `Raised` frame on the router's side: the engine's exception, by kind."""

    def __init__(self, raised: Raised) -> None:
        super().__init__(f"{raised.type}: {raised.message}")
        self.raised = raised


class StreamCut(ConnectionError):
    """The answer ended before its end frame: the replica (or the connection) went away."""


class EndpointUnusable(ConnectionError):
    """The endpoint answered something other than a call's stream or a stale token's 401
    (another program on the port, a router and engine of different versions): nothing
    ran, and the call goes over Serve's channel."""


def encode_request(req: OpenAIRequest) -> bytes | None:
    """The request as msgpack, or None where msgpack cannot carry it (an integer beyond 64
    bits, a lone surrogate in a string of the client's body): such a request takes Serve's
    channel instead."""
    try:
        return msgspec.msgpack.encode(req)
    except (OverflowError, TypeError, ValueError):
        return None


_request = msgspec.msgpack.Decoder(OpenAIRequest)


def decode_request(data: bytes) -> OpenAIRequest:
    return _request.decode(data)


def reply_frame(item: Reply) -> bytes:
    return _frame(_REPLY, msgspec.msgpack.encode(item))


def raised_frame(raised: Raised) -> bytes:
    return _frame(_RAISED, msgspec.msgpack.encode(raised))


END_FRAME = _HEADER.pack(_END, 0)


def _frame(kind: bytes, payload: bytes) -> bytes:
    return _HEADER.pack(kind, len(payload)) + payload


class _Reader(Protocol):
    async def readexactly(self, n: int) -> bytes: ...

    async def read(self, n: int = -1) -> bytes: ...


_reply = msgspec.msgpack.Decoder(Reply)
_raised = msgspec.msgpack.Decoder(Raised)


async def replies(reader: _Reader) -> AsyncIterator[Reply]:
    """The replies of one answer, in order; EngineRaised for an exception the engine raised,
    StreamCut where the answer ends before its end frame. A final reply is handed on once
    the frame after it is read: the caller stops at a final reply, and a connection whose
    answer was read to its end goes back to the pool (one released unread is closed); a
    cut after it loses nothing."""
    held: Reply | None = None
    while True:
        try:
            kind, n = _HEADER.unpack(await reader.readexactly(_HEADER.size))
            payload = await reader.readexactly(n) if n else b""
        except Exception as e:  # a cut: asyncio's short read, aiohttp's payload error
            if held is not None:
                yield held  # the answer was whole
                return
            if isinstance(e, asyncio.IncompleteReadError):
                raise StreamCut("the engine replica's answer ended before its end") from e
            raise
        if kind == _END:
            # The body's own end, so the connection is reusable; the answer is whole
            # whatever happens to the connection now.
            with contextlib.suppress(Exception):
                await reader.read()
            if held is not None:
                yield held
            return
        if held is not None:
            yield held
            held = None
        if kind == _RAISED:
            raise EngineRaised(_raised.decode(payload))
        item = _reply.decode(payload)
        if item.final:
            held = item
        else:
            yield item


def raised_of(e: BaseException, client_errors: tuple[type[BaseException], ...],
              never_ran: tuple[type[BaseException], ...],
              crashed: tuple[type[BaseException], ...]) -> Raised:
    """How the engine replica sends an exception of its own: the classes that decide the
    router's answer (a 400, a retry elsewhere, a quarantine) become a kind."""
    kind: RaisedKind = ("never_ran" if isinstance(e, never_ran) else
                     "engine_crashed" if isinstance(e, crashed) else "request")
    param: Any = getattr(e, "parameter", None)
    return Raised(kind, type(e).__name__, str(e)[:2000], isinstance(e, client_errors),
                  param if isinstance(param, str) else None)
