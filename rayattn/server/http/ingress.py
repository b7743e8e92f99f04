"""What the OpenAI-compatible ingress does per request: authorize, validate, render, route,
stream back. The HTTP routes that call it are in rayattn/server/api.py."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from rayattn import compat
from rayattn.config.loader import parse_models
from rayattn.config.schema import RayAttnConfig
from rayattn.engine.protocol import OpenAIRequest
from rayattn.routing.policies import Decision
from rayattn.routing.response_homes import ResponseHomes
from rayattn.server import front_door
from rayattn.server.dispatch import Dispatcher, Gates, Slot
from rayattn.server.http.body import read_object
from rayattn.server.http.errors import APIError, EngineFailure, client_error, from_validation
from rayattn.server.http.replies import Arrival, Replies, Stream
from rayattn.server.model_route import ModelRoute
from rayattn.server.tenancy import field_limits
from rayattn.server.tenancy.keys import Keys, cache_salt, key_id

log = logging.getLogger("rayattn.ingress")
REQUEST_ID_HEADER = "x-request-id"


class Ingress:
    def __init__(self, args: dict[str, Any], engines: Any) -> None:
        """`engines`: each base model's engine deployment handle, by served name (or, for
        one model, its handle alone)."""
        from rayattn import logs

        logs.setup()
        cfgs = parse_models(args)
        if not isinstance(engines, dict):
            engines = {cfgs[0].model.name: engines}
        self.gates = Gates.of(cfgs[0].router)
        self.routes = {c.model.name: ModelRoute(c, engines[c.model.name], self.gates)
                       for c in cfgs}
        """One per base model, in the config's order (the first answers requests that name
        no model, as `vllm serve` answers them with its first served name)."""
        self._by_model = {n: r for r in self.routes.values() for n in r.cfg.model.served_names}
        # Router settings and the router's own serve settings are shared by every model.
        self.cfg = cfgs[0]
        self.keys = Keys.from_env(self.cfg.router)
        self.response_homes = ResponseHomes()
        from rayattn.metrics import tracing

        self.tracing = tracing.make(self.cfg.tracing, "router")
        self._check_front_door()

    def _check_front_door(self) -> None:
        """How clients reach this router, for /health, with a warning where that is not what
        rayattn sets up (Serve's proxy, or HAProxy hashing another header)."""
        self.front_door = front_door.report(self.cfg.router.session_header)
        if self.front_door["note"]:
            log.warning("%s", self.front_door["note"])

    @property
    def dispatchers(self) -> list[Dispatcher]:
        return [r.dispatcher for r in self.routes.values()]

    def apply_router_config(self, router: dict[str, Any]) -> None:
        """New router settings on a running router (Serve's reconfigure): limits and
        thresholds apply to the next request; a new policy or index mode keeps the engines
        and their caches (a new index resyncs from the engines)."""
        from rayattn.config.schema import RouterConfig

        new = RouterConfig.model_validate(router)
        keys = Keys.from_env(new)  # fails the update (not the requests) when a key is missing
        for route in self.routes.values():
            # Checked against every model's engine part before any model takes it.
            RayAttnConfig.model_validate({**route.cfg.model_dump(), "router": new.model_dump()})
        for route in self.routes.values():
            route.cfg.router = new
        self.keys = keys
        self._check_front_door()  # the session header may have changed
        for d in self.dispatchers:
            d.apply_router_config(new)
        log.info("router settings applied: %s", new.model_dump())

    def _authorize(self, request: Request, admin: bool = False) -> str | None:
        return self.keys.check(request.headers.get("authorization"), admin)

    def _is_admin(self, request: Request) -> bool:
        """Whether the caller could open the admin API (every caller where no keys are
        configured). Only such callers see the router's account of a request (replica,
        predicted cache hits, other replicas' load) and /health's details: to a tenant,
        where another tenant's prompt is cached is an oracle on that prompt."""
        try:
            self._authorize(request, admin=True)
            return True
        except APIError:
            return False

    # --- plumbing -----------------------------------------------------------------------
    async def _start(self) -> None:
        if slow := os.environ.get("RAYATTN_SLOW_CALLBACK_S"):
            # Diagnosis (bench/gpu/profile_router.sh): asyncio logs every step that holds
            # this loop longer than this, i.e. what delays every other request.
            loop = asyncio.get_running_loop()
            if not loop.get_debug():
                loop.set_debug(True)
                loop.slow_callback_duration = float(slow)
        for route in self.routes.values():
            await route.start()

    async def synced(self) -> None:
        """Return once every engine's KV event view has its first snapshot, or after
        kv_feeds.SYNC_GRACE_S; from then on the router takes traffic whatever its feeds do
        (Serve calls this through reconfigure before the first request)."""
        for d in self.dispatchers:
            d.feeds.hold()
        while any(d.feeds.syncing() for d in self.dispatchers):
            await asyncio.sleep(0.05)
        for d in self.dispatchers:
            d.feeds.release()

    async def _body(self, request: Request, kind: str,
                    key: str | None) -> tuple[dict[str, Any], Any, ModelRoute]:
        """The JSON body, in the caller's cache namespace, vLLM's request model of it
        (vLLM's own validation), and the base model it names."""
        data = await read_object(request, self.cfg.router)
        field_limits.check(kind, data, self.cfg.router.limits)
        salt = cache_salt(self.cfg.router.cache_isolation, key, data.get("cache_salt"),
                          self.keys.api is not None)
        if salt is not None:
            data["cache_salt"] = salt
        model = data.get("model")
        route = next(iter(self.routes.values())) if model is None else \
            self._route_of(model) if isinstance(model, str) else None
        if route is None:
            # vLLM's own answer, given here before the prompt is rendered and routed.
            raise APIError(404, f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")
        try:
            body = compat.openai_model(kind).model_validate(data)
        except ValidationError as e:
            raise from_validation(e) from None
        except RecursionError:
            raise APIError(400, "request body nested too deeply") from None
        except compat.client_error_types() as e:  # vLLM's own checks beyond pydantic's
            raise client_error(e) from None
        return data, body, route

    async def handle(self, request: Request, kind: str) -> Response:
        request.state.arrived = Arrival.now()
        if self.tracing is None:
            return await self._handle(request, kind)
        span = self.tracing.tracer.start_span(
            "rayattn.request", context=self.tracing.context_from(request.headers),
            start_time=int(request.state.arrived.wall * 1e9),
            attributes={"rayattn.kind": kind, "http.route": request.url.path})
        request.state.span = span
        try:
            response = await self._handle(request, kind)
        except BaseException:
            span.end()
            raise
        span.set_attribute("http.status_code", response.status_code)
        response.headers.update(self.tracing.carrier(span))
        if isinstance(response, Stream):
            response.on_close = span.end  # when the last event is out
        else:
            span.end()
        return response

    async def _handle(self, request: Request, kind: str) -> Response:
        try:
            rid = request_id(request)
        except APIError as e:
            return e.response()
        try:
            key = self._authorize(request)
            field_limits.check_session(self.cfg.router.session_header,
                                 request.headers.get(self.cfg.router.session_header),
                                 self.cfg.router.limits)
            await self._start()
            data, body, route = await self._body(request, kind, key)
            tenant = key_id(key)
            slot = route.dispatcher.admit(tenant, field_limits.engine_requests(kind, data))
        except APIError as e:
            return e.response()
        # From here the slot is ours until the response ends; whichever path ends the
        # request releases it (once).
        try:
            return await self._admitted(request, kind, data, body, rid, slot, tenant, route)
        except BaseException:
            slot.release()
            raise

    async def _admitted(self, request: Request, kind: str, data: dict[str, Any], body: Any,
                        rid: str, slot: Slot, tenant: str, model: ModelRoute) -> Response:
        try:
            prompt = await model.render(kind, body)
        except APIError as e:
            slot.release()
            return e.response()
        stored: Callable[[Decision], None] | None = None
        pinned = None
        if kind == "responses":
            # vLLM's id of the answer is the request id: always a new one, named here (a
            # client's x-request-id may repeat across turns, and an id chosen in the body
            # could overwrite another tenant's stored conversation).
            response_id = data["request_id"] = body.request_id = f"resp_{uuid.uuid4().hex}"
            prev = body.previous_response_id
            if prev is not None:
                home = self.response_homes.home(prev)
                if home is not None and home.tenant != tenant:
                    slot.release()  # another tenant's: as unknown as it is to vLLM
                    return APIError(404, f"Response with id '{prev}' not found.",
                                    param="previous_response_id").response()
                pinned = home.replica if home and home.model == model.name else None

            def stored(d: Decision) -> None:
                self.response_homes.stored(response_id, tenant, model.name, d.replica)
        else:
            data["request_id"] = rid
        stream = bool(body.stream)
        dispatcher = model.dispatcher
        oreq = OpenAIRequest(kind, data, rid, dispatcher.stream_interval_s(),
                             log=self.cfg.router.log_requests,
                             engine_inputs=prompt.engine_inputs)
        route = dispatcher.core.request(
            prompt.token_ids, request.headers.get(self.cfg.router.session_header), prompt.text,
            salt=body.cache_salt, adapter=model.adapter(body.model))
        route.pinned = pinned
        span = getattr(request.state, "span", None)
        if span is not None:
            span.set_attribute("rayattn.request_id", rid)
            span.set_attribute("rayattn.model", body.model or model.name)
            oreq.trace = self.tracing.carrier(span)
        deadline = asyncio.get_running_loop().time() + self.cfg.router.request_timeout_s
        out = Replies(request.state.arrived, self._is_admin(request),
                      self.cfg.router.request_timeout_s)
        if stream:
            # The first item before the response starts: a request that fails before any
            # output (no replica, vLLM rejects it, timeout) gets its real status code.
            items = dispatcher.generate(oreq, route, tenant=tenant)
            try:
                async with asyncio.timeout_at(deadline):
                    first, decision = await anext(items)
            except (APIError, EngineFailure, TimeoutError, StopAsyncIteration) as e:
                slot.release()
                await items.aclose()
                return out.failed(None if isinstance(e, StopAsyncIteration) else e)
            except BaseException:
                await items.aclose()
                raise
            if first.status != 200:
                slot.release()
                await items.aclose()
                return out.passthrough(first, decision)
            if stored is not None:
                stored(decision)
            self._route_span(span, decision, out.arrived)
            return out.stream(first, decision, items, deadline, slot)
        return await self._complete(dispatcher, oreq, route, out, slot, tenant, stored, span)

    async def _complete(self, dispatcher: Dispatcher, req: OpenAIRequest, route: Any,
                        out: Replies, slot: Slot, tenant: str,
                        stored: Callable[[Decision], None] | None = None,
                        span: Any = None) -> Response:
        last, decision = None, None
        try:
            async with asyncio.timeout(self.cfg.router.request_timeout_s):
                # Buffered: nothing reaches the client before the answer is whole, so the
                # dispatcher may retry a replica failure at any point.
                async for item, d in dispatcher.generate(req, route, buffered=True,
                                                         tenant=tenant):
                    if item.final:
                        last, decision = item, d
        except (APIError, EngineFailure, TimeoutError) as e:
            return out.failed(e)
        finally:
            slot.release()
        if last is None or decision is None:
            return out.failed(None)
        self._route_span(span, decision, out.arrived)
        if last.status != 200:
            return out.passthrough(last, decision)
        if stored is not None:
            stored(decision)
        return out.whole(last, decision)

    def _route_span(self, parent: Any, d: Decision, arrived: Arrival) -> None:
        """The router's own part of a traced request: from its arrival to the engine call,
        with the decision's account."""
        if parent is None or self.tracing is None or not d.dispatched_at:
            return
        from opentelemetry import trace

        start = arrived.wall
        span = self.tracing.tracer.start_span(
            "rayattn.route", context=trace.set_span_in_context(parent),
            start_time=int(start * 1e9), attributes={
                "rayattn.replica": d.replica, "rayattn.route_reason": d.reason,
                "rayattn.predicted_cached_tokens": d.predicted_cached_tokens,
                "rayattn.regret_tokens": d.regret_tokens,
                "rayattn.moved_from": d.moved_from or ""})
        span.end(end_time=int((start + d.dispatched_at - arrived.perf) * 1e9))

    def _route_of(self, model: str) -> ModelRoute | None:
        """The base model a `model` names: itself, a configured adapter of it, or one
        loaded at run time."""
        return self._by_model.get(model) or next(
            (r for r in self.routes.values() if r.adapter(model) is not None), None)

    async def lora_admin(self, request: Request, action: str) -> Response:
        """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, on every engine of the
        base model (`base_model_name`, else the first): for admin callers, since the path
        is read on the engines' nodes."""
        try:
            self._authorize(request, admin=True)
            await self._start()
            data = await read_object(request, self.cfg.router, empty_ok=True)
            base = data.get("base_model_name")
            model = self.routes.get(base) if base else next(iter(self.routes.values()))
            if model is None:
                raise APIError(404, f"The model `{base}` does not exist.",
                               param="base_model_name")
            if not model.cfg.model.lora.runtime_updates:
                raise APIError(404, f"run-time LoRA updates are off for {model.name} "
                                    "(model.lora.runtime_updates)")
            name = data.get("lora_name")
            if not isinstance(name, str) or not 0 < len(name) <= 128:
                raise APIError(400, "lora_name: 1 to 128 characters", param="lora_name")
            if action == "unload":
                reply = await model.unload_adapter(name)
            else:
                path = data.get("lora_path")
                if not isinstance(path, str) or not path:
                    raise APIError(400, "lora_path: the adapter's directory on the engines' "
                                        "nodes", param="lora_path")
                owner = self._route_of(name)
                if name in self.routes or (owner is not None and owner is not model):
                    raise APIError(400, f"lora_name: `{name}` already names a model",
                                   param="lora_name")
                reply = await model.load_adapter(name, path)
        except APIError as e:
            return e.response()
        if reply.status != 200:
            return Response(reply.data, status_code=reply.status,
                            media_type="application/json")
        return Response(json.loads(reply.data)["message"], media_type="text/plain")

    async def admin_reset(self, request: Request) -> Response:
        if not self.cfg.router.admin_api:
            return APIError(404, "admin API disabled (router.admin_api)").response()
        try:
            self._authorize(request, admin=True)
        except APIError as e:
            return e.response()
        await self._start()
        from rayattn.config.schema import RouterConfig

        try:
            data = await read_object(request, self.cfg.router, empty_ok=True)
            # Validate everything before changing anything; unnamed settings stay as they are.
            # `settings`: other router settings for the runs after this reset (a benchmark's
            # variants on the same engines), as the router's user_config would set them.
            settings = data.get("settings") or {}
            if not isinstance(settings, dict):
                raise APIError(400, "settings must be an object of router settings",
                               param="settings")
            now = self.dispatchers[0].snapshot()  # every model's routing runs the same
            current = {**self.cfg.router.model_dump(), "policy": now.policy,
                       "index": now.index_mode}
            want = RouterConfig.model_validate(
                {**current, **settings,
                 **{k: data[k] for k in ("policy", "index") if data.get(k)}})
            wanted = want.model_dump()
            changed = [k for k in wanted if wanted[k] != current.get(k)]
            if changed and self.cfg.serve.max_routers > 1:
                # One request reaches one router replica: the others would keep routing
                # with the old settings, and a comparison of policies would mix them.
                raise APIError(409, f"this deployment runs up to "
                               f"{self.cfg.serve.max_routers} router replicas and "
                               "/admin/reset reaches one: change router settings through "
                               "the Serve config's user_config (every replica applies "
                               "it), then reset without them", param=changed[0])
            if any(k != "policy" for k in changed):
                # Same path as a live router setting: a new index resyncs from the engines.
                self.apply_router_config(wanted)
            for d in self.dispatchers:
                policy = await d.reset(want.policy)
        except APIError as e:
            return e.response()
        except ValidationError as e:
            return from_validation(e).response()
        except ValueError as e:  # e.g. a key variable the new settings name holds no key
            return APIError(400, str(e)).response()
        after = [d.snapshot() for d in self.dispatchers]
        return JSONResponse({"policy": policy, "index": after[0].index_mode,
                             "replicas_up": [r for a in after for r in a.replicas_up]})

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except APIError as e:
            return e.response()
        await self._start()
        # vLLM's own cards (names, max_model_len, adapters with their parent) from each base
        # model's engines; a model none of whose engines serves yet is left out.
        cards = [await r.models() for r in self.routes.values()]
        if all(c is None for c in cards):
            return self._not_ready().response()
        return JSONResponse({"object": "list", "data": [m for c in cards if c for m in c]})

    def _not_ready(self) -> APIError:
        down = [r for r in self.routes.values() if not r.dispatcher.live()]
        if len(self.routes) == 1 or not down:
            return next(iter(self.routes.values())).not_ready()
        names = ", ".join(r.name for r in down)
        return APIError(503, f"not ready: no engine replica of {names} serves yet (engines "
                             "load the model at start-up; retry shortly)", retry_after=5)

    async def health(self, request: Request) -> Response:
        await self._start()
        snaps = {n: r.dispatcher.snapshot() for n, r in self.routes.items()}
        first = next(iter(snaps.values()))
        live = [r for s in snaps.values() for r in s.replicas_up]
        # Ready when every model has an engine serving: a balancer must not send a model's
        # requests to a router that cannot serve them. Nor, while it starts, before its view
        # of each engine's cache is taken (Serve holds traffic back until then too, see
        # Router.reconfigure): routed now, a conversation's next turn would find no history.
        syncing = [t for s in snaps.values() for t in s.syncing]
        ready = all(s.replicas_up for s in snaps.values()) and not syncing
        reason = None
        if syncing:  # a count: replica names are for operators
            reason = (f"not ready: taking the KV cache view of {len(syncing)} engine "
                      "target(s); retry shortly")
        elif not ready:
            reason = self._not_ready().message
        body: dict[str, Any] = {"status": "ok" if ready else "unavailable", "reason": reason,
                                "up": len(live), "of": sum(s.replicas for s in snaps.values())}
        headers = None if ready else {"Retry-After": "5"}
        if not self._is_admin(request):
            # Probes need only the status; pids, GPU ids, replica names and live load are
            # for operators.
            return JSONResponse(body, status_code=200 if ready else 503, headers=headers)
        body |= {"replicas_up": live, "syncing": syncing,
                 "replicas": sum(s.replicas for s in snaps.values()),
                 "joined": sum(s.joined for s in snaps.values()), "policy": first.policy,
                 "router_pid": os.getpid(), "front_door": self.front_door,
                 "limits": {"max_inflight": first.max_inflight},
                 "index": first.index_mode,
                 # The gates' counts are the router's own (one set for all models).
                 "counts": {**_summed(s.counts for s in snaps.values()),
                            **self.gates.counts(),
                            **_summed(r.render_counts() for r in self.routes.values())},
                 "regret_tokens": _summed(s.regret_tokens for s in snaps.values()),
                 "session_moves": _summed(s.session_moves for s in snaps.values()),
                 "engines": {n: asdict(e) for s in snaps.values() for n, e in s.engines.items()}}
        if len(snaps) > 1:
            body["models"] = {n: {"up": len(s.replicas_up), "of": s.replicas,
                                  "engines": sorted(s.engines)} for n, s in snaps.items()}
        return JSONResponse(body, status_code=200 if ready else 503, headers=headers)


def _summed(counters: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in counters:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return out


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
