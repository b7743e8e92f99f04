"""What the OpenAI routes do per request: authorize, validate, render, route, stream back.
The routes that call it are in api.py; how the answer is written, in replies.py."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from rayattn import compat
from rayattn.config.schema import RayAttnConfig
from rayattn.engine.protocol import OpenAIRequest
from rayattn.routing.policies import Decision, RouteRequest
from rayattn.routing.response_homes import ResponseHomes
from rayattn.server.errors import APIError, EngineFailure, client_error, from_validation
from rayattn.server.http.access import Access
from rayattn.server.http.bases import Bases
from rayattn.server.http.body import read_object
from rayattn.server.http.replies import Arrival, Replies, drop
from rayattn.server.http.spans import Spans
from rayattn.server.model_route import ModelRoute
from rayattn.server.tenancy import field_limits
from rayattn.server.tenancy.admission import Slot
from rayattn.server.tenancy.keys import cache_salt, key_id

REQUEST_ID_HEADER = "x-request-id"


@dataclass
class Admitted:
    """One request the router took on, from its admission to the end of its answer."""

    kind: str
    rid: str
    tenant: str
    session: str | None
    model: ModelRoute
    data: dict[str, Any]
    """The body as the engine gets it (cache_salt and request_id set by the router)."""
    body: Any
    """vLLM's request model of `data`."""
    slot: Slot
    """Released once, by whichever path ends the request."""
    out: Replies
    span: Any = None
    stored: Callable[[Decision], None] | None = None
    """For a Responses request: records which replica holds the stored answer."""


class RequestPath:
    def __init__(self, cfg: RayAttnConfig, bases: Bases, access: Access,
                 spans: Spans | None) -> None:
        """`cfg`: the first model's config, whose `router` section (shared by every model)
        is replaced in place by new router settings."""
        self.cfg, self.bases, self.access, self.spans = cfg, bases, access, spans
        self.response_homes = ResponseHomes()

    async def handle(self, request: Request, kind: str) -> Response:
        arrived = Arrival.now()
        if self.spans is None:
            return await self._handle(request, kind, arrived, None)
        span = self.spans.opened(request, kind, arrived)
        try:
            response = await self._handle(request, kind, arrived, span)
        except BaseException:
            span.end()
            raise
        return self.spans.answered(span, response)

    async def _handle(self, request: Request, kind: str, arrived: Arrival,
                      span: Any) -> Response:
        try:
            rid = request_id(request)
        except APIError as e:
            return e.response()
        rc = self.cfg.router
        try:
            key = self.access.caller(request)
            session = request.headers.get(rc.session_header)
            field_limits.check_session(rc.session_header, session, rc.limits)
            await self.bases.start()
            data, body, model = await self._parsed(request, kind, key)
            account = self.access.is_admin(request)
            tenant = key_id(key)
            slot = model.dispatcher.admit(tenant, field_limits.engine_requests(kind, data))
        except APIError as e:
            return e.response()
        # From here the slot is ours until the response ends; whichever path ends the
        # request releases it (once).
        try:
            return await self._admitted(Admitted(
                kind, rid, tenant, session, model, data, body, slot,
                Replies(arrived, account, rc.request_timeout_s, rc.stream_commit_s), span))
        except BaseException:
            slot.release()
            raise

    async def _parsed(self, request: Request, kind: str,
                      key: str | None) -> tuple[dict[str, Any], Any, ModelRoute]:
        """The JSON body, in the caller's cache namespace, vLLM's request model of it
        (vLLM's own validation), and the base model it names."""
        rc = self.cfg.router
        data = await read_object(request, rc)
        field_limits.check(kind, data, rc.limits)
        salt = cache_salt(rc.cache_isolation, key, data.get("cache_salt"),
                          self.access.keys.api is not None)
        if salt is not None:
            data["cache_salt"] = salt
        model = data.get("model")
        route = self.bases.first if model is None else \
            self.bases.named(model) if isinstance(model, str) else None
        if route is None:
            # vLLM's own answer, given here before the prompt is rendered and routed.
            raise APIError(404, f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")
        return data, validated(kind, data), route

    async def _admitted(self, x: Admitted) -> Response:
        try:
            prompt = await x.model.render(x.kind, x.body)
            pinned = self._identified(x)
        except APIError as e:
            x.slot.release()
            return e.response()
        dispatcher = x.model.dispatcher
        oreq = OpenAIRequest(x.kind, x.data, x.rid, dispatcher.stream_interval_s(),
                             log=self.cfg.router.log_requests,
                             engine_inputs=prompt.engine_inputs)
        route = dispatcher.core.request(
            prompt.token_ids, x.session, prompt.text, salt=x.body.cache_salt,
            adapter=x.model.adapter(x.body.model))
        route.pinned = pinned
        if self.spans is not None and x.span is not None:
            oreq.trace = self.spans.named(x.span, x.rid, x.body.model or x.model.name)
        if x.body.stream:
            return await self._streamed(x, oreq, route)
        return await self._buffered(x, oreq, route)

    def _identified(self, x: Admitted) -> str | None:
        """The engine request's id set in the body; for a Responses request, the replica
        holding the stored conversation it continues (None: any)."""
        if x.kind != "responses":
            x.data["request_id"] = x.rid
            return None
        # vLLM's id of the answer is the request id: always a new one, named here (a
        # client's x-request-id may repeat across turns, and an id chosen in the body
        # could overwrite another tenant's stored conversation).
        response_id = x.data["request_id"] = x.body.request_id = f"resp_{uuid.uuid4().hex}"
        homes, tenant, model = self.response_homes, x.tenant, x.model.name
        x.stored = lambda d: homes.stored(response_id, tenant, model, d.replica)
        prev = x.body.previous_response_id
        if prev is None:
            return None
        home = homes.home(prev)
        if home is not None and home.tenant != tenant:
            # Another tenant's: as unknown as it is to vLLM.
            raise APIError(404, f"Response with id '{prev}' not found.",
                           param="previous_response_id")
        return home.replica if home and home.model == model else None

    async def _streamed(self, x: Admitted, oreq: OpenAIRequest,
                        route: RouteRequest) -> Response:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + x.out.timeout_s
        # The first item before the response starts: a request that fails before any
        # output (no replica, vLLM rejects it, timeout) gets its real status code, unless
        # the first item takes longer than the commit time (replies.Replies.waiting).
        items = x.model.dispatcher.generate(oreq, route, tenant=x.tenant)
        head = asyncio.ensure_future(anext(items))
        try:
            while True:
                await asyncio.wait({head}, timeout=min(x.out.commit_s,
                                                       deadline - loop.time()))
                # Only a request queued behind load commits: one that waits for an engine
                # to come up keeps its real answer (503 + Retry-After) for the client's
                # retry, within NO_REPLICA_GRACE_S.
                if head.done() or loop.time() >= deadline or route.queued:
                    break
        except BaseException:
            await drop(head, items)
            raise
        if not head.done():
            if loop.time() < deadline:
                return x.out.waiting(head, items, deadline, x.slot,
                                     lambda d: self._started(x, d))
            await drop(head, items)
            x.slot.release()
            return x.out.failed(TimeoutError())
        try:
            first, decision = head.result()
        except (APIError, EngineFailure, StopAsyncIteration) as e:
            x.slot.release()
            await items.aclose()
            return x.out.failed(None if isinstance(e, StopAsyncIteration) else e)
        except BaseException:
            await items.aclose()
            raise
        if first.status != 200:
            x.slot.release()
            await items.aclose()
            return x.out.passthrough(first, decision)
        self._started(x, decision)
        return x.out.stream(first, decision, items, deadline, x.slot)

    def _started(self, x: Admitted, decision: Decision) -> None:
        """A streamed answer's first token came from the replica `decision` chose."""
        if x.stored is not None:
            x.stored(decision)
        self._routed(x, decision)

    async def _buffered(self, x: Admitted, oreq: OpenAIRequest,
                        route: RouteRequest) -> Response:
        last, decision = None, None
        try:
            async with asyncio.timeout(x.out.timeout_s):
                # Buffered: nothing reaches the client before the answer is whole, so the
                # dispatcher may retry a replica failure at any point.
                async for item, d in x.model.dispatcher.generate(oreq, route, buffered=True,
                                                                 tenant=x.tenant):
                    if item.final:
                        last, decision = item, d
        except (APIError, EngineFailure, TimeoutError) as e:
            return x.out.failed(e)
        finally:
            x.slot.release()
        if last is None or decision is None:
            return x.out.failed(None)
        self._routed(x, decision)
        if last.status != 200:
            return x.out.passthrough(last, decision)
        if x.stored is not None:
            x.stored(decision)
        return x.out.whole(last, decision)

    def _routed(self, x: Admitted, d: Decision) -> None:
        if self.spans is not None and x.span is not None:
            self.spans.routed(x.span, d, x.out.arrived)


def validated(kind: str, data: dict[str, Any]) -> Any:
    """vLLM's request model of `data`, its validation errors as the client's 400."""
    try:
        return compat.openai_model(kind).model_validate(data)
    except ValidationError as e:
        raise from_validation(e) from None
    except RecursionError:
        raise APIError(400, "request body nested too deeply") from None
    except compat.client_error_types() as e:  # vLLM's own checks beyond pydantic's
        raise client_error(e) from None


def request_id(request: Request) -> str:
    """The client's `x-request-id` (so one request can be followed through router and engine
    logs) or a new one. vLLM makes `chatcmpl-<id>` / `cmpl-<id>` of it: the engine request's
    id and the response's `id`. Serve's HTTP proxy passes the client's header on, sets its
    own request id there when the client sent none, and echoes it in the response's
    `x-request-id` header (so this router does not add one)."""
    given = request.headers.get(REQUEST_ID_HEADER)
    if given is None:
        return uuid.uuid4().hex
    if not 0 < len(given) <= 128 or not given.isprintable():
        raise APIError(400, f"{REQUEST_ID_HEADER}: 1 to 128 printable characters",
                       param=REQUEST_ID_HEADER)
    return given
