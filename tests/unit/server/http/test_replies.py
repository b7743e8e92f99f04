"""How answers go back to the client (rayattn/server/http/replies.py): vLLM's own bytes, the
router's account added only for callers allowed to see it, errors once output has started
as an error event, and a stream that gives its slot and engine call back however it ends."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from starlette.requests import ClientDisconnect

from rayattn.engine.protocol import Reply
from rayattn.routing.policies import Decision
from rayattn.server.errors import EngineFailure
from rayattn.server.http.replies import (
    REPLICA_HEADER,
    WAITING,
    Arrival,
    Replies,
    Stream,
    add_key,
    ext,
    hops,
)
from rayattn.server.tenancy.admission import Admission

ARRIVED = Arrival(perf=100.0, wall=1_700_000_000.0)
DECISION = Decision("engine-1", "affinity_hit", 64, costs={"engine-1": 0.123456},
                    dispatched_at=100.25)
STAMPS = {"router_out": 10.0, "engine_in": 10.5, "engine_out": 11.0, "router_in": 11.25}
BODY = json.dumps({"id": "chatcmpl-x", "choices": [{"message": {"content": "hi"}}]})


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _items(*replies: Reply | BaseException) -> tuple[AsyncGenerator, list[str]]:
    """The dispatcher's items after the first: each reply with DECISION, or an exception
    raised where it stands. The list records that the generator was closed."""
    closed: list[str] = []

    async def gen() -> AsyncGenerator[tuple[Reply, Decision], None]:
        try:
            for r in replies:
                if isinstance(r, BaseException):
                    raise r
                yield r, DECISION
        finally:
            closed.append("closed")

    return gen(), closed


async def _drain(events: Any) -> list[str]:
    return [e async for e in events]


def test_add_key_makes_the_account_the_objects_last_member():
    assert json.loads(add_key(BODY, {"replica": "engine-1"}))["rayattn"] == {
        "replica": "engine-1"}
    assert json.loads(add_key("{}", {"a": 1})) == {"rayattn": {"a": 1}}
    assert json.loads(add_key('{"a": 1}  \n', {})) == {"a": 1, "rayattn": {}}


def test_hops_split_the_way_to_the_first_token_only_with_every_stamp():
    assert hops(STAMPS) == {"to_engine_s": 0.5, "in_engine_s": 0.5, "from_engine_s": 0.25}
    assert hops({k: v for k, v in STAMPS.items() if k != "engine_in"}) is None
    assert hops({}) is None


def test_ext_accounts_for_the_decision_and_the_routers_own_hop():
    last = Reply(BODY, final=True, timings={"path": "extend", "ttft_s": 0.5},
                 served_by={"pid": 7}, rendered_by_router=True)
    out = ext(last, DECISION, ARRIVED, STAMPS)
    assert out["replica"] == "engine-1" and out["route_reason"] == "affinity_hit"
    assert out["predicted_cached_tokens"] == 64 and out["costs"] == {"engine-1": 0.1235}
    assert out["router_s"] == 0.25 and out["hops"] == hops(STAMPS)
    assert out["path"] == "extend" and out["engine_ttft_s"] == 0.5
    assert out["engine_prefill_s"] is None and out["served_by"] == {"pid": 7}
    assert out["arrived_at"] == ARRIVED.wall and out["first_item_at"] == 11.25
    assert out["rendered_by_router"] is True
    undispatched = Decision("engine-1", "no_replica", 0)
    assert ext(Reply("{}"), undispatched, ARRIVED, {})["router_s"] is None


@pytest.mark.parametrize("account", [True, False])
def test_a_whole_answer_is_vllms_bytes_with_the_account_only_for_operators(account):
    r = Replies(ARRIVED, account, 300, 1.0).whole(Reply(BODY, final=True, stamps=STAMPS), DECISION)
    assert r.status_code == 200 and r.media_type == "application/json"
    if account:
        body = json.loads(r.body)
        assert body["rayattn"]["replica"] == r.headers[REPLICA_HEADER] == "engine-1"
        assert {k: v for k, v in body.items() if k != "rayattn"} == json.loads(BODY)
    else:
        assert r.body == BODY.encode() and REPLICA_HEADER not in r.headers


@pytest.mark.parametrize("account", [True, False])
def test_vllms_error_passes_through_with_its_status(account):
    err = json.dumps({"error": {"message": "bad", "code": 400}})
    r = Replies(ARRIVED, account, 300, 1.0).passthrough(Reply(err, status=422), DECISION)
    assert r.status_code == 422 and r.body == err.encode()
    assert (REPLICA_HEADER in r.headers) == account


def test_a_request_ended_without_an_answer_gets_the_routers_error():
    replies = Replies(ARRIVED, True, 42.0, 1.0)
    timeout = replies.failed(TimeoutError())
    assert timeout.status_code == 504
    assert json.loads(timeout.body)["error"]["message"] == "request exceeded 42.0s"
    empty = replies.failed(None)
    assert empty.status_code == 503 and empty.headers["retry-after"] == "2"


async def test_events_pass_vllms_sse_on_with_the_account_on_the_last_json_event():
    head = Reply(_sse({"id": "c", "choices": [{"delta": {"role": "assistant"}}]}),
                 stamps=STAMPS)
    usage = {"id": "c", "choices": [], "usage": {"prompt_tokens": 3}}
    final = Reply(_sse({"id": "c", "choices": [{"delta": {"content": "x"}}]}) + _sse(usage)
                  + "data: [DONE]\n\n", final=True)
    items, closed = _items(Reply(""), final)
    out = await _drain(Replies(ARRIVED, True, 300, 1.0).events(head, DECISION, items, 1e12))
    assert out[0] == head.data and len(out) == 2  # an empty item sends nothing
    events = [e for e in out[1].split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["rayattn"]["hops"] == hops(STAMPS)
    assert "rayattn" not in json.loads(events[0][6:])
    assert closed == ["closed"]
    items, _ = _items(final)
    plain = await _drain(Replies(ARRIVED, False, 300, 1.0).events(head, DECISION, items, 1e12))
    assert plain == [head.data, final.data]


@pytest.mark.parametrize("failure,status", [
    (EngineFailure("engine-1", RuntimeError("gone"), started=True), 503),
    (None, 503),  # the engine ended the stream without its final item
])
async def test_a_failure_after_output_started_is_an_error_event_then_done(failure, status):
    head = Reply(_sse({"id": "c", "choices": []}))
    items, closed = _items(*([failure] if failure else []))
    out = await _drain(Replies(ARRIVED, True, 300, 1.0).events(head, DECISION, items, 1e12))
    assert out[0] == head.data and out[-1] == "data: [DONE]\n\n"
    err = json.loads(out[1].removeprefix("data: "))["error"]
    assert err["code"] == status
    if failure is not None:
        assert "mid-stream" in err["message"]
    assert closed == ["closed"]


async def test_a_stream_gives_its_slot_and_engine_call_back_however_it_ends():
    admission = Admission(4)
    ended: list[str] = []

    async def gone(message: dict[str, Any]) -> None:
        raise OSError("client gone")

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    for send in (gone, None):
        slot = admission.acquire("key")
        items, closed = _items(Reply("data: {}\n\n"), Reply("data: {}\n\n", final=True))
        await anext(items)  # the head: the engine call is under way when the stream is made
        stream = Stream(_drain_to_text(items), slot, items, media_type="text/event-stream")
        stream.on_close = lambda: ended.append("span")
        if send is None:
            sent: list[dict[str, Any]] = []

            async def send(message: dict[str, Any], sent: list = sent) -> None:
                sent.append(message)

            await stream(scope, receive, send)
            assert sent[0]["status"] == 200
        else:
            with pytest.raises(ClientDisconnect):  # Starlette's account of the OSError
                await stream(scope, receive, send)
        assert admission.inflight == 0 and closed == ["closed"]
    assert ended == ["span", "span"]


async def _drain_to_text(items: AsyncGenerator) -> AsyncGenerator[str, None]:
    async for reply, _ in items:
        yield reply.data


def _later(result: Any, after_s: float) -> asyncio.Future:
    """The task awaiting a stream's first item: `result` (or raised) after `after_s`."""
    async def first() -> Any:
        await asyncio.sleep(after_s)
        if isinstance(result, BaseException):
            raise result
        return result
    return asyncio.ensure_future(first())


async def test_a_late_first_token_is_waited_for_with_comments_then_streamed():
    """The response starts before the first token (so a proxy in front writes to the client
    and notices one that left); the token and the rest follow as from `stream`."""
    head = Reply(_sse({"id": "c", "choices": []}), stamps=STAMPS)
    final = Reply(_sse({"id": "c", "choices": []}) + "data: [DONE]\n\n", final=True)
    items, closed = _items(final)
    started: list[Decision] = []
    replies = Replies(ARRIVED, False, 300, 0.02)
    out = await _drain(replies._waited(_later((head, DECISION), 0.1), items, 1e12,
                                       started.append))
    waits = [e for e in out if e == WAITING]
    assert len(waits) >= 2 and out[:len(waits)] == waits  # before anything else
    assert out[len(waits):] == [head.data, final.data]
    assert started == [DECISION] and closed == ["closed"]


@pytest.mark.parametrize("first,status", [
    (TimeoutError(), 504),  # never came: the router's deadline
    (EngineFailure("engine-1", RuntimeError("gone"), started=False), 503),
    ((Reply(json.dumps({"error": {"message": "too long", "code": 400}}), status=400,
            final=True), DECISION), 400),  # vLLM's own refusal
])
async def test_after_the_response_started_a_failure_is_an_error_event(first, status):
    items, _ = _items()
    started: list[Decision] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (0.05 if isinstance(first, TimeoutError) else 60)
    head = _later(first, 3600 if isinstance(first, TimeoutError) else 0.03)
    out = await _drain(Replies(ARRIVED, False, 300, 0.01)._waited(head, items, deadline,
                                                                 started.append))
    assert out[0] == WAITING and out[-1] == "data: [DONE]\n\n"
    assert json.loads(out[-2].removeprefix("data: "))["error"]["code"] == status
    assert started == []
    head.cancel()


def _waiting_on_a_queued_call(slot: Any) -> tuple[Stream, asyncio.Future, list[str]]:
    """A waiting stream (comments every 10 ms) on an engine call queued behind a busy fleet,
    the task awaiting its first item, and whether that call was cancelled."""
    cancelled: list[str] = []

    async def gen() -> AsyncGenerator[tuple[Reply, Decision], None]:
        try:
            await asyncio.sleep(3600)
            yield Reply("data: {}\n\n"), DECISION
        except asyncio.CancelledError:
            cancelled.append("engine call")
            raise

    items = gen()
    head = asyncio.ensure_future(anext(items))
    stream = Replies(ARRIVED, False, 300, 0.01).waiting(head, items, 1e12, slot,
                                                       lambda d: None)
    return stream, head, cancelled


async def test_a_client_gone_while_the_first_token_is_awaited_ends_the_engine_call():
    """The stream's end cancels the task awaiting the first item before the engine call is
    closed (a generator cannot be closed while another task runs it): nothing stays on an
    engine for a client that left, and the slot comes back."""
    admission = Admission(4)
    stream, head, cancelled = _waiting_on_a_queued_call(admission.acquire("key"))
    await asyncio.sleep(0)  # the engine call is under way
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message.get("body", b"") == WAITING.encode():
            raise OSError("client gone")  # the proxy hung up when it wrote this

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    with pytest.raises(ClientDisconnect):
        await stream({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
    assert sent[0]["status"] == 200
    assert cancelled == ["engine call"] and head.cancelled()
    assert admission.inflight == 0


async def test_a_client_gone_while_queued_ends_the_engine_call_on_uvicorns_asgi_too():
    """As uvicorn runs it (ASGI spec 2.3: Starlette listens for the disconnect beside the
    stream instead of failing a send), the hang-up HAProxy passes on after a waiting comment
    ends the stream, cancels the task awaiting the first item and gives the slot back."""
    admission = Admission(4)
    stream, head, cancelled = _waiting_on_a_queued_call(admission.acquire("key"))
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        while sum(m.get("body", b"") == WAITING.encode() for m in sent) < 3:
            await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    await asyncio.wait_for(stream({"type": "http", "asgi": {"spec_version": "2.3"}},
                                  receive, send), 10)
    assert sent[0]["status"] == 200
    assert cancelled == ["engine call"] and head.cancelled()
    assert admission.inflight == 0
