"""The direct transport (router.engine_transport: direct) over loopback: the engine
replica's endpoint with a scripted `serve` in place of vLLM, the router's client, and how
the router's retry loop reads what comes back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from rayattn.engine import wire
from rayattn.engine.direct_server import DirectServer
from rayattn.engine.protocol import (
    DirectAddress,
    EngineDown,
    EngineInfo,
    Misrouted,
    OpenAIRequest,
    Reply,
)
from rayattn.server.errors import engine_raised
from rayattn.server.fleet.replica_set import failure
from rayattn.server.forwarding.direct_client import DirectClient


class BadField(ValueError):
    parameter = "max_tokens"


def classify(e: BaseException) -> wire.Raised:
    return wire.raised_of(e, (ValueError,), (Misrouted, EngineDown), (RuntimeError,))


class Engine:
    """What the endpoint calls: records what reached it, and when a call ended."""

    def __init__(self) -> None:
        self.seen: list[tuple[str | None, OpenAIRequest]] = []
        self.ended: list[str] = []
        self.raise_: BaseException | None = None
        self.items = 3
        self.gap_s = 0.0
        self.hold_s = 0.0
        """After the first item: a long prefill or a queue, with nothing to write."""

    async def serve(self, target: str | None, req: OpenAIRequest) -> AsyncIterator[Reply]:
        self.seen.append((target, req))
        try:
            if self.raise_ is not None:
                raise self.raise_
            for i in range(self.items):
                await asyncio.sleep(self.gap_s)
                yield Reply(f"data: {i}\n\n", final=i == self.items - 1,
                            token_ids=[i, 70000 + i], stamps={"engine_in": 1.5},
                            inflight_stamp=(123, i), timings={"path": "extend"})
                if i == 0:
                    await asyncio.sleep(self.hold_s)
        finally:
            self.ended.append(req.request_id)


@pytest.fixture
async def endpoint():
    engine = Engine()
    server = DirectServer(engine.serve, classify)
    address = await server.address("127.0.0.1")
    client = DirectClient()
    yield engine, server, address, client
    await client.close()
    await server.drain(0)


def request(rid: str = "r1") -> OpenAIRequest:
    return OpenAIRequest("chat", {"messages": [{"role": "user", "content": "hi"}],
                                  "temperature": 0.5},
                         rid, engine_inputs=[{"type": "token", "prompt_token_ids": [1, 2, 3]}],
                         origin="router-a", engine_rank=1)


async def collect(client: DirectClient, address: DirectAddress, replica: str,
                  req: OpenAIRequest) -> list[Reply]:
    body = wire.encode_request(req)
    assert body is not None
    return [r async for r in client.stream(address, replica, body)]


async def test_a_call_reaches_the_named_replica_and_its_replies_come_back_whole(endpoint):
    engine, _, address, client = endpoint
    got = await collect(client, address, "eng-1", request())
    (target, req), = engine.seen
    assert target == "eng-1" and req == request()
    assert [r.data for r in got] == ["data: 0\n\n", "data: 1\n\n", "data: 2\n\n"]
    assert got[1].token_ids == [1, 70001] and got[1].inflight_stamp == (123, 1)
    assert got[2].final and got[2].timings == {"path": "extend"}


async def test_a_caller_that_stops_at_the_final_reply_leaves_the_connection_reusable(
        endpoint):
    """The router stops reading at a final reply (server/http/replies.py); the client has read
    the answer to its end by then, so the next call reuses the connection."""
    engine, server, address, client = endpoint
    for rid in ("r1", "r2", "r3"):
        body = wire.encode_request(request(rid))
        assert body is not None
        async for item in client.stream(address, "eng-1", body):
            if item.final:
                break
    assert len(engine.seen) == 3
    await asyncio.sleep(0.05)  # a connection released unread would be closed by now
    assert len(server._runner.server.connections) == 1


async def test_concurrent_first_probes_start_one_endpoint():
    server = DirectServer(Engine().serve, classify)
    first, *rest = await asyncio.gather(*(server.address("127.0.0.1") for _ in range(4)))
    assert first is not None and all(a == first for a in rest)
    await server.drain(0)


async def test_the_token_is_required_and_never_shown(endpoint):
    engine, _, address, client = endpoint
    assert address.token not in repr(address)
    assert address.token not in repr(EngineInfo("e", 0, 1, "b", 16, 1, 1, 1, 0.0,
                                                direct=address))
    with pytest.raises(wire.EngineRaised) as err:
        await collect(client, DirectAddress(address.url, "wrong"), "eng-1", request())
    # A stale address (another process took the port) is a call that never ran: retried.
    assert failure(err.value) == "never_ran"
    assert engine.seen == []


@pytest.mark.parametrize(("exc", "kind", "status"), [
    (BadField("max_tokens must be at least 1"), "request", 400),
    (KeyError("boom"), "request", 500),
    (Misrouted("call for engine replica x reached y"), "never_ran", None),
    (EngineDown("engine of y is dead"), "never_ran", None),
    (RuntimeError("engine core died"), "engine_crashed", None),
])
async def test_the_engines_exceptions_keep_their_meaning_for_the_retry_loop(
        endpoint, exc, kind, status):
    engine, _, address, client = endpoint
    engine.raise_ = exc
    with pytest.raises(wire.EngineRaised) as err:
        await collect(client, address, "eng-1", request())
    assert failure(err.value) == kind
    if status is not None:
        answer = engine_raised(err.value)
        assert answer.status == status
        if status == 400:
            assert answer.param == "max_tokens" and "at least 1" in answer.message


@pytest.mark.parametrize(("items", "gap_s", "hold_s", "read"), [
    (2, 0.0, 60.0, 1),        # silent: nothing to write for a minute (queued, prefilling)
    (100_000, 0.0, 0.0, 50),  # writing as fast as it can when the router hangs up
])
async def test_hanging_up_ends_the_call_on_the_engine_at_once(endpoint, items, gap_s, hold_s,
                                                               read):
    engine, server, address, client = endpoint
    engine.items, engine.gap_s, engine.hold_s = items, gap_s, hold_s
    body = wire.encode_request(request())
    assert body is not None
    got = 0
    async for _ in client.stream(address, "eng-1", body):
        got += 1
        if got == read:
            assert server.inflight == 1 and engine.ended == []
            break
    for _ in range(100):
        if engine.ended:
            break
        await asyncio.sleep(0.02)
    assert engine.ended == ["r1"] and server.inflight == 0


async def test_drain_waits_for_running_calls(endpoint):
    engine, server, address, client = endpoint
    engine.items, engine.gap_s = 50, 0.05  # longer than the runner's own 1 s to close
    running = asyncio.ensure_future(collect(client, address, "eng-1", request()))
    while not server.inflight:
        await asyncio.sleep(0.01)
    drained = asyncio.ensure_future(server.drain(30))
    await asyncio.sleep(0.1)
    assert not drained.done()  # the running call is not cut
    got = await running
    await drained
    assert len(got) == 50 and got[-1].final


@pytest.mark.parametrize("after_final", [True, False])
async def test_a_cut_after_the_final_reply_loses_nothing(after_final):
    """The answer is whole at its final reply: a connection lost before the end frame
    must not make the router run the request again; one lost before it is a dead replica.
    Over a real connection, as aiohttp reports a cut chunked body."""

    async def cut(request: web.BaseRequest) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(wire.reply_frame(Reply("data: x\n\n")))
        if after_final:
            await resp.write(wire.reply_frame(Reply("", final=True)))
        await asyncio.sleep(0.05)
        request.transport.abort()
        return resp

    runner = web.ServerRunner(web.Server(cut))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    client = DirectClient()
    try:
        stream = client.stream(DirectAddress(f"http://127.0.0.1:{port}", "t"), "e", b"")
        if after_final:
            assert [r.final async for r in stream] == [False, True]
        else:
            with pytest.raises(Exception) as err:
                [r async for r in stream]
            assert failure(err.value) == "replica_died"
    finally:
        await client.close()
        await runner.cleanup()


async def test_a_draining_replica_refuses_new_calls_as_never_run(endpoint):
    engine, server, address, client = endpoint
    server.draining = True
    with pytest.raises(wire.EngineRaised) as err:
        await collect(client, address, "eng-1", request())
    assert failure(err.value) == "never_ran" and engine.seen == []


async def test_a_replica_gone_mid_answer_or_unreachable_is_a_dead_replica(endpoint):
    engine, server, address, client = endpoint
    engine.items, engine.gap_s = 1000, 0.01
    body = wire.encode_request(request())
    assert body is not None
    got = 0
    with pytest.raises((wire.StreamCut, aiohttp.ClientError)) as err:
        async for _ in client.stream(address, "eng-1", body):
            got += 1
            if got == 2:  # the process dies: its listener and connections go at once
                for conn in list(server._runner.server.connections):
                    conn.transport.abort()
                await server._runner.cleanup()
    assert failure(err.value) == "replica_died"
    with pytest.raises(aiohttp.ClientConnectionError) as err:
        await collect(client, address, "eng-1", request())
    assert failure(err.value) == "replica_died"


def test_a_body_msgpack_cannot_carry_takes_serves_channel():
    assert wire.encode_request(OpenAIRequest("chat", {"seed": 2 ** 70}, "r")) is None
    assert wire.encode_request(OpenAIRequest("chat", {"user": "\ud800"}, "r")) is None
    assert wire.decode_request(wire.encode_request(request()) or b"") == request()
