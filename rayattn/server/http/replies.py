"""How an answer goes back to the client: vLLM's own bytes (a JSON body, or SSE events as the
engine wrote them), with the router's account of the request (`rayattn`, the replica header)
added for callers allowed to see it, and the router's own errors where no answer came."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from fastapi.responses import Response, StreamingResponse

from rayattn.engine.protocol import Reply
from rayattn.routing.policies import Decision
from rayattn.server.errors import APIError, EngineFailure, failed_request
from rayattn.server.tenancy.admission import Slot

REPLICA_HEADER = "x-rayattn-replica"
Items = AsyncGenerator[tuple[Reply, Decision], None]
"""What Dispatcher.generate yields: each reply of the engine with the decision behind it."""


class Arrival(NamedTuple):
    """When a request reached the router's handler: perf_counter for its own hop, wall clock
    to set against the client's and the engine's stamps."""

    perf: float
    wall: float

    @classmethod
    def now(cls) -> Arrival:
        return cls(time.perf_counter(), time.time())


WAITING = ": waiting\n\n"
"""An SSE comment: what a stream sends while its first token is awaited (clients skip it)."""


class Stream(StreamingResponse):
    """A streaming response that gives its admission slot and its engine call back however
    it ends: finished, client gone, or never started (Starlette does not close a generator
    it never ran, and the engine call would hold its slot until garbage collection).
    `head`: the task awaiting the first item, where the response started before it came."""

    def __init__(self, content: AsyncIterator[str], slot: Slot, upstream: Items,
                 head: asyncio.Future | None = None, **kw: Any) -> None:
        super().__init__(content, **kw)
        self._slot, self._upstream, self._head = slot, upstream, head
        self.on_close: Callable[[], Any] | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await drop(self._head, self._upstream)
            finally:
                self._slot.release()
                if self.on_close is not None:
                    self.on_close()


@dataclass(frozen=True)
class Replies:
    """How one request's answer is written: `account`, whether the caller sees the router's
    account of it (only callers that could open the admin API: to a tenant, where another
    tenant's prompt is cached is an oracle on that prompt); `timeout_s`, the router's
    deadline named in its timeout error."""

    arrived: Arrival
    account: bool
    timeout_s: float
    commit_s: float
    """How long a stream's first token is awaited before the response starts anyway, and
    how often it then sends WAITING (router.stream_commit_s)."""

    def headers(self, d: Decision) -> dict[str, str] | None:
        return {REPLICA_HEADER: d.replica} if self.account else None

    def failed(self, e: BaseException | None) -> Response:
        """The client's error for a request that ended without an answer (errors.py)."""
        return failed_request(e, self.timeout_s).response()

    def passthrough(self, reply: Reply, d: Decision) -> Response:
        """vLLM's own error answer (JSON, as the engine always sends), with its status."""
        return Response(reply.data, status_code=reply.status, media_type="application/json",
                        headers=self.headers(d))

    def whole(self, last: Reply, d: Decision) -> Response:
        """A buffered answer: vLLM's body as it wrote it, with the router's account added
        (no parse, no dump)."""
        body = add_key(last.data, ext(last, d, self.arrived, last.stamps)) if self.account \
            else last.data
        return Response(body, media_type="application/json", headers=self.headers(d))

    def stream(self, head: Reply, d: Decision, items: Items,
               deadline: float, slot: Slot) -> Stream:
        """The SSE response from its first item on; it owns `slot` and `items` from here."""
        return Stream(self.events(head, d, items, deadline), slot, items,
                      media_type="text/event-stream", headers=self.headers(d))

    def _failed_events(self, e: BaseException) -> tuple[str, str]:
        """A stream's end where no answer came: the router's error as an event, then
        [DONE]."""
        err = None if isinstance(e, StopAsyncIteration) else e
        return event(failed_request(err, self.timeout_s).body()), "data: [DONE]\n\n"

    def waiting(self, head: asyncio.Future, items: Items, deadline: float, slot: Slot,
                started: Callable[[Decision], None]) -> Stream:
        """The SSE response of a request whose first item `head` still awaits: WAITING
        until it comes, then as `stream`. Whatever ends the request after this is an
        event in the stream; `started` is told the decision behind a first token."""
        return Stream(self._waited(head, items, deadline, started), slot, items, head=head,
                      media_type="text/event-stream")

    async def _waited(self, head: asyncio.Future, items: Items, deadline: float,
                      started: Callable[[Decision], None]) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        try:
            while not head.done():
                left = deadline - loop.time()
                if left <= 0:
                    raise TimeoutError
                yield WAITING
                await asyncio.wait({head}, timeout=min(self.commit_s, left))
            first, decision = head.result()
        except (StopAsyncIteration, APIError, EngineFailure, TimeoutError) as e:
            for part in self._failed_events(e):
                yield part
            return
        if first.status != 200:
            # vLLM's own error answer: its JSON body ({"error": ...}) as one event.
            yield event(json.loads(first.data))
            yield "data: [DONE]\n\n"
            return
        started(decision)
        async for ev in self.events(first, decision, items, deadline):
            yield ev

    async def events(self, head: Reply, decision: Decision,
                     items: Items, deadline: float) -> AsyncIterator[str]:
        """vLLM's SSE events as the engine produced them; the router's own account of the
        request (`rayattn`) rides on the last event before [DONE]. A failure after the
        response started can only be an error event in it."""
        item = head
        try:
            async with asyncio.timeout_at(deadline):
                while True:
                    if item.final:
                        yield (with_ext(item.data, ext(item, decision, self.arrived,
                                                       head.stamps))
                               if self.account else item.data)
                        return
                    if item.data:
                        yield item.data
                    item, decision = await anext(items)
        except (StopAsyncIteration, APIError, EngineFailure, TimeoutError) as e:
            for part in self._failed_events(e):
                yield part
        finally:
            await items.aclose()


async def drop(head: asyncio.Future | None, items: Items) -> None:
    """Ends an answer's engine call, whose first item may still be awaited in `head`'s own
    task (the generator cannot be closed while that task runs it)."""
    if head is not None:
        if not head.done():
            head.cancel()
            await asyncio.wait({head})
        if not head.cancelled():
            head.exception()  # retrieved: nobody else will
    await items.aclose()


def event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def with_ext(sse: str, ext: dict[str, Any]) -> str:
    """`sse` with `ext` added as "rayattn" to its last JSON event (the usage event when the
    client asked for one, else the one carrying finish_reason). The engine keeps those
    events for the final item (openai_layer.py)."""
    events = sse.split("\n\n")
    for i in range(len(events) - 1, -1, -1):
        ev = events[i]
        if ev.startswith("data: {"):
            if not ev.startswith('data: {"error"'):
                events[i] = "data: " + add_key(ev[6:], ext)
            return "\n\n".join(events)
    return sse


def add_key(obj_json: str, ext: dict[str, Any]) -> str:
    """A JSON object's text with "rayattn": ext as its last member."""
    head = obj_json.rstrip()[:-1].rstrip()
    return f'{head}{"" if head.endswith("{") else ","}"rayattn":{json.dumps(ext)}}}'


def ext(last: Reply, d: Decision, arrived: Arrival, stamps: dict[str, float]) -> dict[str, Any]:
    """The router's account of a request: where it went and why, and where its time went."""
    t = last.timings or {}
    return {"replica": d.replica, "route_reason": d.reason, "moved_from": d.moved_from,
            "regret_tokens": d.regret_tokens,
            "predicted_cached_tokens": d.predicted_cached_tokens,
            "predicted_reload_tokens": d.predicted_reload_tokens, "path": t.get("path"),
            "engine_ttft_s": t.get("ttft_s"), "engine_prefill_s": t.get("prefill_s"),
            "engine_queue_s": t.get("queue_s"), "engine_itl_s": t.get("itl_s"),
            "served_by": last.served_by,
            "loads": d.loads, "costs": {r: round(v, 4) for r, v in d.costs.items()},
            # The router's own hop: request in (after the HTTP proxy) → engine call issued.
            "router_s": round(d.dispatched_at - arrived.perf, 6) if d.dispatched_at else None,
            # The rest of the way to the first token, by wall clock (one host's, or NTP's):
            # the call's way to the engine replica, the engine's own (render, queue, prefill,
            # first token), the first chunk's way back to the router.
            "hops": hops(stamps),
            # Wall clock: the client's way in (to this handler) and the first item's way out
            # (from here) are measured against these.
            "arrived_at": arrived.wall, "first_item_at": stamps.get("router_in"),
            "rendered_by_router": last.rendered_by_router}


def hops(s: dict[str, float]) -> dict[str, float] | None:
    if not {"router_out", "engine_in", "engine_out", "router_in"} <= set(s):
        return None
    return {"to_engine_s": round(s["engine_in"] - s["router_out"], 6),
            "in_engine_s": round(s["engine_out"] - s["engine_in"], 6),
            "from_engine_s": round(s["router_in"] - s["engine_out"], 6)}
