"""What the OpenAI-compatible ingress does per request: authorize, parse, template, route,
stream back. The HTTP routes that call it are in rayattn/server/api.py."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from rayattn.config.architecture import local_model_dir
from rayattn.config.loader import parse_args
from rayattn.config.plan import build_plan
from rayattn.engine.protocol import Chunk, GenerateRequest
from rayattn.routing.policies import Decision
from rayattn.server.dispatch import Dispatcher, EngineFailure, Slot
from rayattn.server.errors import APIError, from_validation
from rayattn.server.protocol import UNSUPPORTED, ChatCompletionRequest, CompletionRequest
from rayattn.server.templating import Templater

log = logging.getLogger("rayattn.ingress")
REQUEST_ID_HEADER = "x-request-id"


class Ingress:
    def __init__(self, args: dict[str, Any], engines: list[Any],
                 policy: str | None = None) -> None:
        from rayattn import logs

        logs.setup()
        self.cfg = parse_args(args)
        plan = build_plan(self.cfg, prepare_model=True)
        self.model_name = self.cfg.model.name
        self.max_model_len = self.cfg.model.max_model_len or 0
        src = local_model_dir(self.cfg.model.source, prepare=True) or self.cfg.model.source
        self.templater = Templater(src, self.cfg.model.trust_remote_code)
        names = {f"engine-{i}": h for i, h in enumerate(engines)}
        self.dispatcher = Dispatcher(self.cfg, plan.block_size, names, policy)
        self.keys = Keys.from_env(self.cfg.router)

    def apply_router_config(self, router: dict[str, Any]) -> None:
        """New router settings on a running router (Serve's reconfigure): limits and
        thresholds apply to the next request; a new policy or index mode keeps the engines
        and their caches (a new index resyncs from the engines)."""
        from rayattn.config.schema import RouterConfig

        new = RouterConfig.model_validate(router)
        keys = Keys.from_env(new)  # fails the update (not the requests) when a key is missing
        self.cfg.router = new  # validate_assignment re-checks it against the engine part
        self.keys = keys
        self.dispatcher.apply_router_config(new)
        log.info("router settings applied: %s", new.model_dump())

    def _authorize(self, request: Request, admin: bool = False) -> None:
        self.keys.check(request.headers.get("authorization"), admin)

    # --- plumbing -----------------------------------------------------------------------
    async def _body(self, request: Request, model_cls: type) -> Any:
        raw = await request.body()
        if len(raw) > self.cfg.router.max_body_bytes:
            raise APIError(413, f"request body of {len(raw)} bytes exceeds the limit of "
                                f"{self.cfg.router.max_body_bytes}")
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise APIError(400, f"malformed JSON body: {str(e)[:200]}") from None
        if not isinstance(data, dict):
            raise APIError(400, "request body must be a JSON object")
        bad = sorted(UNSUPPORTED & data.keys())
        if bad:
            raise APIError(400, f"{bad[0]}: unsupported parameter", param=bad[0])
        try:
            body = model_cls.model_validate(data)
        except ValidationError as e:
            raise from_validation(e) from None
        except RecursionError:
            raise APIError(400, "request body nested too deeply") from None
        if body.model != self.model_name:
            raise APIError(404, f"model {body.model!r} does not exist; served: "
                                f"{self.model_name!r}", param="model")
        return body

    def _limits(self, prompt: list[int], body: Any) -> int:
        limit = self.max_model_len or self._engine_max_len()
        if len(prompt) >= limit:
            raise APIError(400, f"prompt is {len(prompt)} tokens, which does not fit the "
                                f"model's maximum context length of {limit} tokens "
                                "(max_model_len)", param="messages")
        room = limit - len(prompt)
        want = body.output_limit
        if want is not None and want > room:
            raise APIError(400, f"max_tokens={want} plus the {len(prompt)}-token prompt "
                                f"exceeds the maximum context length of {limit} tokens",
                           param="max_tokens")
        bad = [t for t in prompt if not 0 <= t < self.templater.vocab_size] \
            if isinstance(getattr(body, "prompt", None), list) else []
        if bad:
            raise APIError(400, f"prompt holds token id {bad[0]} outside the vocabulary "
                                f"(0..{self.templater.vocab_size - 1})", param="prompt")
        return want or room

    def _engine_max_len(self) -> int:
        for s in self.dispatcher.replicas.replicas.values():
            if s.info:
                return s.info["max_model_len"]
        return 2**31

    async def handle(self, request: Request, kind: str) -> Response:
        t0 = time.time()
        request.state.arrived = time.perf_counter()
        try:
            rid = request_id(request, "chatcmpl" if kind == "chat" else "cmpl")
        except APIError as e:
            return e.response()
        try:
            self._authorize(request)
            await self.dispatcher.start()
            body = await self._body(request, ChatCompletionRequest if kind == "chat"
                                    else CompletionRequest)
            slot = self.dispatcher.admit()
        except APIError as e:
            return e.response()
        # From here the slot is ours until the response ends; whichever path ends the
        # request releases it (once).
        try:
            return await self._admitted(request, kind, body, t0, rid, slot)
        except BaseException:
            slot.release()
            raise

    async def _admitted(self, request: Request, kind: str, body: Any, t0: float,
                        rid: str, slot: Slot) -> Response:
        try:
            if kind == "chat":
                messages = [m.model_dump(exclude_none=True) for m in body.messages]
                for m, orig in zip(messages, body.messages, strict=True):
                    m["content"] = orig.text()
                if not any(m["content"] for m in messages):
                    raise APIError(400, "messages: all messages are empty", param="messages")
                prompt = await asyncio.to_thread(self.templater.chat, messages)
                text = "\n".join(m["content"] for m in messages)
            else:
                if isinstance(body.prompt, str) and not body.prompt:
                    raise APIError(400, "prompt: empty", param="prompt")
                prompt = await asyncio.to_thread(self.templater.completion, body.prompt)
                text = body.prompt if isinstance(body.prompt, str) else ""
            max_tokens = self._limits(prompt, body)
        except APIError as e:
            slot.release()
            return e.response()
        greq = GenerateRequest(rid, prompt, body.sampling_kwargs(max_tokens),
                               self.cfg.router.stream_interval_ms / 1e3 if body.stream
                               else float("inf"), log=self.cfg.router.log_requests)
        route = self.dispatcher.route_request(
            prompt, request.headers.get(self.cfg.router.session_header), text)
        deadline = asyncio.get_running_loop().time() + self.cfg.router.request_timeout_s
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            # The first chunk before the response starts: a request that fails before any
            # output (no replica, the engine rejects it, timeout) gets its real status code.
            chunks = self.dispatcher.generate(greq, route)
            try:
                async with asyncio.timeout_at(deadline):
                    first = await anext(chunks)
            except (APIError, EngineFailure, TimeoutError, StopAsyncIteration) as e:
                slot.release()
                await chunks.aclose()
                return _early_error(e, self.cfg.router.request_timeout_s).response()
            except BaseException:
                await chunks.aclose()
                raise
            return _Stream(self._sse(kind, rid, int(t0), first, chunks, include_usage,
                                     request.state.arrived, deadline), slot,
                           media_type="text/event-stream")
        return await self._complete(kind, rid, int(t0), greq, route,
                                    bool(body.return_token_ids), request.state.arrived, slot)

    async def _complete(self, kind: str, rid: str, created: int, greq: GenerateRequest,
                        route: Any, return_token_ids: bool, arrived: float,
                        slot: Slot) -> Response:
        text, last, decision = [], None, None
        token_ids: list[int] = []
        try:
            async with asyncio.timeout(self.cfg.router.request_timeout_s):
                # Buffered: nothing reaches the client before the answer is whole, so the
                # dispatcher may retry a replica failure at any point.
                async for chunk, d in self.dispatcher.generate(greq, route, buffered=True):
                    text.append(chunk.text)
                    token_ids.extend(chunk.token_ids)
                    last, decision = chunk, d
        except APIError as e:
            return e.response()
        except EngineFailure as e:
            return APIError(503, f"engine failure: {e}", retry_after=2).response()
        except TimeoutError:
            return APIError(504, f"request exceeded {self.cfg.router.request_timeout_s}s")\
                .response()
        finally:
            slot.release()
        assert last is not None and decision is not None
        content = "".join(text)
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": content},
                      "finish_reason": last.finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": content, "finish_reason": last.finish_reason,
                      "logprobs": None}
        if return_token_ids:
            choice.update(prompt_token_ids=greq.prompt_token_ids, token_ids=token_ids)
        return JSONResponse({
            "id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": created, "model": self.model_name, "choices": [choice],
            "usage": _usage(last), "rayattn": _ext(last, decision, arrived)},
            headers={"x-rayattn-replica": decision.replica})

    async def _sse(self, kind: str, rid: str, created: int, head: tuple[Chunk, Decision],
                   chunks: AsyncIterator[tuple[Chunk, Decision]], include_usage: bool,
                   arrived: float, deadline: float) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        first = True
        last = None

        def event(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        async def all_chunks() -> AsyncIterator[tuple[Chunk, Decision]]:
            yield head
            async for item in chunks:
                yield item

        try:
            async with asyncio.timeout_at(deadline):
                async for chunk, decision in all_chunks():
                    last = chunk
                    if kind == "chat":
                        delta: dict[str, Any] = {"content": chunk.text}
                        if first:
                            delta["role"] = "assistant"
                        choice = {"index": 0, "delta": delta,
                                  "finish_reason": chunk.finish_reason, "logprobs": None}
                    else:
                        choice = {"index": 0, "text": chunk.text,
                                  "finish_reason": chunk.finish_reason, "logprobs": None}
                    first = False
                    payload = {"id": rid, "object": obj, "created": created,
                               "model": self.model_name, "choices": [choice]}
                    if chunk.finish_reason is not None:
                        payload["rayattn"] = _ext(chunk, decision, arrived)
                    yield event(payload)
            if include_usage and last is not None:
                yield event({"id": rid, "object": obj, "created": created,
                             "model": self.model_name, "choices": [], "usage": _usage(last)})
            yield "data: [DONE]\n\n"
        except APIError as e:
            yield event(e.body())
            yield "data: [DONE]\n\n"
        except EngineFailure as e:
            yield event(APIError(503, f"engine failure mid-stream: {e}").body())
            yield "data: [DONE]\n\n"
        except TimeoutError:
            yield event(APIError(504, "request timed out").body())
            yield "data: [DONE]\n\n"
        finally:
            await chunks.aclose()

    async def admin_reset(self, request: Request) -> Response:
        if not self.cfg.router.admin_api:
            return APIError(404, "admin API disabled (router.admin_api)").response()
        try:
            self._authorize(request, admin=True)
        except APIError as e:
            return e.response()
        await self.dispatcher.start()
        from rayattn.config.schema import RouterConfig

        d = self.dispatcher
        try:
            data = json.loads(await request.body() or b"{}")
            if not isinstance(data, dict):
                raise APIError(400, "request body must be a JSON object")
            # Validate everything before changing anything; unnamed settings stay as they are.
            current = {**self.cfg.router.model_dump(), "policy": d.policy.name,
                       "index": d.view.mode}
            want = RouterConfig.model_validate(
                {**current, **{k: data[k] for k in ("policy", "index") if data.get(k)}})
            if want.index != current["index"]:
                # Same path as a live router setting: a new index resyncs from the engines.
                self.apply_router_config(want.model_dump())
            policy = await d.reset(want.policy)
        except APIError as e:
            return e.response()
        except ValidationError as e:
            return from_validation(e).response()
        except ValueError as e:
            return APIError(400, str(e)).response()
        return JSONResponse({"policy": policy, "index": self.dispatcher.view.mode,
                             "replicas_up": self.dispatcher.live()})

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except APIError as e:
            return e.response()
        await self.dispatcher.start()
        if not self.dispatcher.live():
            return self._not_ready().response()
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rayattn",
             "max_model_len": self._engine_max_len()}]})

    def _not_ready(self) -> APIError:
        n = len(self.dispatcher.replicas.replicas)
        return APIError(503, f"not ready: 0 of {n} engine replicas serve yet (engines load "
                             "the model at start-up; retry shortly)", retry_after=5)

    async def health(self) -> Response:
        await self.dispatcher.start()
        live = self.dispatcher.live()
        d = self.dispatcher
        body = {"status": "ok" if live else "unavailable", "replicas_up": live,
                "reason": None if live else self._not_ready().message,
                "replicas": len(d.replicas.replicas), "policy": d.policy.name,
                "router_pid": os.getpid(),
                "limits": {"max_inflight": d.admission.limit},
                "index": d.view.mode,
                "counts": {**d.counts, "admitted_now": d.admission.inflight,
                           "admitted_peak": d.admission.peak},
                "engines": {n: {"up": r.up, "pid": r.info.get("pid"),
                                "inflight": d.load.inflight[n], "local": d.load.local[n],
                                "unfinished": r.info.get("unfinished"),
                                "downs": r.downs, "slow_probes": r.slow_probes,
                                "kv_blocks": r.info.get("num_gpu_blocks"),
                                "backend": r.info.get("backend"),
                                "block_size": r.info.get("block_size"),
                                "engine_pids": r.info.get("engine_pids", []),
                                "devices": r.info.get("devices", []),
                                "cache_view": d.view.stats(n)}
                            for n, r in d.replicas.replicas.items()}}
        if not live:
            return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})
        return JSONResponse(body)


class _Stream(StreamingResponse):
    """A streaming response that gives its admission slot back however it ends: finished,
    client gone, or never started (Starlette does not close a generator it never ran)."""

    def __init__(self, content: AsyncIterator[str], slot: Slot, **kw: Any) -> None:
        super().__init__(content, **kw)
        self._slot = slot

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._slot.release()


def _early_error(e: BaseException, timeout_s: float) -> APIError:
    """What a stream that failed before its first chunk answers with."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineFailure):
        return APIError(503, f"engine failure: {e}", retry_after=2)
    if isinstance(e, TimeoutError):
        return APIError(504, f"request exceeded {timeout_s}s")
    return APIError(503, "the engine ended the request without output", retry_after=2)


def request_id(request: Request, prefix: str) -> str:
    """The client's `x-request-id` (so one request can be followed through router and engine
    logs) or a new one; it is the engine's request id and the response's `id`. Serve's HTTP
    proxy passes the client's header on and sets its own request id there when the client
    sent none, and echoes it in the response's `x-request-id` header (so this router does
    not add one)."""
    given = request.headers.get(REQUEST_ID_HEADER)
    if given is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    if not 0 < len(given) <= 128 or not given.isprintable():
        raise APIError(400, f"{REQUEST_ID_HEADER}: 1 to 128 printable characters",
                       param=REQUEST_ID_HEADER)
    return given


class Keys:
    """API keys from environment variables of the router process (a Kubernetes Secret in
    the rendered manifests), never from the Serve config. No variable named: no auth."""

    def __init__(self, api: list[str] | None, admin: list[str]) -> None:
        self.api, self.admin = api, admin

    @classmethod
    def from_env(cls, rc: Any) -> Keys:
        def read(var: str | None, field: str) -> list[str]:
            if var is None:
                return []
            keys = [k.strip() for k in os.environ.get(var, "").split(",") if k.strip()]
            if not keys:
                raise ValueError(f"router.{field}: environment variable {var} holds no key on "
                                 "the router (refusing to serve without the keys it names)")
            return keys
        api = read(rc.api_keys_env, "api_keys_env") if rc.api_keys_env else None
        return cls(api, read(rc.admin_keys_env, "admin_keys_env"))

    def check(self, authorization: str | None, admin: bool) -> None:
        import hmac

        wanted = self.admin if admin else self.api
        if wanted is None or (admin and self.api is None and not self.admin):
            return  # no auth configured
        scheme, _, token = (authorization or "").strip().partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        if not given or not any(hmac.compare_digest(given, k.encode()) for k in wanted):
            raise APIError(401, "missing or invalid API key (Authorization: Bearer <key>)"
                           + (" for the admin API" if admin else ""), code="invalid_api_key")


def _usage(last: Any) -> dict:
    return {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
            "total_tokens": last.prompt_tokens + last.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": last.num_cached_tokens}}


def _ext(last: Any, d: Decision, arrived: float) -> dict:
    t = last.timings or {}
    return {"replica": d.replica, "route_reason": d.reason,
            "predicted_cached_tokens": d.predicted_cached_tokens, "path": t.get("path"),
            "engine_ttft_s": t.get("ttft_s"), "served_by": last.served_by,
            "loads": d.loads, "costs": {r: round(v, 4) for r, v in d.costs.items()},
            # The router's own hop: request in (after the HTTP proxy) → engine call issued.
            "router_s": round(d.dispatched_at - arrived, 6) if d.dispatched_at else None}
