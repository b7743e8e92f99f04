"""vLLM's own OpenAI serving layer over one replica's engine.

Parsing, chat rendering (templates, `chat_template_kwargs`, tools), sampling parameters,
structured outputs, reasoning and tool-call parsing, logprobs, `n`, stop strings and usage
are vLLM's (the objects `vllm serve` builds through init_app_state), so a client that works
against `vllm serve` works here. This module only carries what goes in and out: it runs one
request, merges a stream's SSE events into fewer Ray messages, and hands back what the
request did in the engine (rayattn/engine/observed.py) for the router and the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from pydantic import ValidationError

from rayattn import compat
from rayattn.engine import observed
from rayattn.engine.protocol import OpenAIRequest, Reply, error_json
from rayattn.integrations import patches, vllm_openai

log = logging.getLogger("rayattn.engine")

# The engine inputs the router rendered for the request this task serves (read by vLLM's
# renderer, patched in integrations/patches.py: serve_rendered_prompts).
_rendered: contextvars.ContextVar[list[dict[str, Any]] | None] = contextvars.ContextVar(
    "rayattn_rendered", default=None)


class OpenAILayer:
    def __init__(self, state: Any, identity: dict[str, Any], metrics: Any,
                 report: Callable[[int | None], dict[str, Any]], tracing: Any = None) -> None:
        self.chat = state.openai_serving_chat
        self.completion = state.openai_serving_completion
        # /v1/responses (vLLM builds it only where the engine generates).
        self.responses = getattr(state, "openai_serving_responses", None)
        self.models = state.openai_serving_models
        self.identity, self.metrics, self.report = identity, metrics, report
        self.tracing = tracing  # rayattn/metrics/tracing.py, None when off
        self.ranks = 1
        """DP ranks of the engine (where several, a request the router sent to none ran
        on a rank vLLM picked, unseen here)."""
        # Render once: the router has rendered the prompt already (its block hashes come
        # from it), and rendering a long chat again here costs this process's event loop and
        # GIL, which also stream every running request's tokens.
        self.takes_rendered = patches.serve_rendered_prompts(state, _rendered)

    @classmethod
    async def create(cls, engine: Any, engine_kwargs: dict[str, Any],
                     frontend: dict[str, Any], identity: dict[str, Any], metrics: Any,
                     report: Callable[[int | None], dict[str, Any]],
                     tracing: Any = None) -> OpenAILayer:
        args = vllm_openai.frontend_namespace(engine_kwargs, frontend, engine.vllm_config)
        state = await vllm_openai.init_openai_state(observed.ObservedEngine(engine), args)
        layer = cls(state, identity, metrics, report, tracing)
        layer.ranks = int(engine_kwargs.get("data_parallel_size", 1))
        return layer

    async def list_models(self) -> dict[str, Any]:
        return (await self.models.show_available_models()).model_dump()

    def _adapter(self, model: Any) -> str:
        """The LoRA adapter a request ran under, configured or loaded at run time ("" for
        the base model): a label of its metrics and spans."""
        return model if model in getattr(self.models, "lora_requests", {}) else ""

    def adapters_served(self) -> dict[str, str]:
        """LoRA adapters this engine answers to now: name: path."""
        return {n: r.lora_path for n, r in getattr(self.models, "lora_requests", {}).items()}

    async def load_adapter(self, name: str, path: str) -> Reply:
        req = compat.lora_admin_model("load")(lora_name=name, lora_path=path)
        return self._admin_reply(await self.models.load_lora_adapter(req))

    async def unload_adapter(self, name: str) -> Reply:
        req = compat.lora_admin_model("unload")(lora_name=name)
        return self._admin_reply(await self.models.unload_lora_adapter(req))

    @staticmethod
    def _admin_reply(result: Any) -> Reply:
        if isinstance(result, compat.openai_model("error")):
            return Reply(result.model_dump_json(),
                         int(getattr(result.error, "code", 400) or 400), final=True)
        return Reply(json.dumps({"message": str(result)}), final=True)

    async def serve(self, req: OpenAIRequest) -> AsyncIterator[Reply]:
        received = time.time()
        first = True
        # aclosing: a caller that goes away closes this generator, and the inner one must
        # close now (aborting the engine request), not when it is collected.
        async with contextlib.aclosing(self._replies(req)) as replies:
            async for item in replies:
                if first:
                    item.stamps = {"engine_in": received, "engine_out": time.time()}
                    first = False
                yield item

    async def _replies(self, req: OpenAIRequest) -> AsyncIterator[Reply]:
        try:
            request = compat.openai_model(req.kind).model_validate(req.body)
        except ValidationError as e:  # the router validated it already: a version skew
            yield Reply(error_json(400, str(e.errors()[:3])), 400, final=True)
            return
        obs = observed.Observation(req.engine_rank)
        observed.current.set(obs)  # seen by ObservedEngine.generate in this task
        given = req.engine_inputs if self.takes_rendered else None
        _rendered.set(given)
        obs.rendered_by_router = given is not None
        serving = {"chat": self.chat.create_chat_completion,
                   "completion": self.completion.create_completion,
                   "responses": getattr(self.responses, "create_responses", None)}[req.kind]
        if serving is None:
            yield Reply(error_json(404, "this engine serves no /v1/responses"), 404,
                        final=True)
            return
        # Closing this generator cancels the call, which aborts the engine request. A
        # non-streamed request's engine outputs come only at the end (vLLM's FINAL_ONLY),
        # so its one item is the whole answer.
        result = await serving(request, None)
        if isinstance(result, compat.openai_model("error")):
            status = int(getattr(result.error, "code", 400) or 400)
            yield Reply(result.model_dump_json(), status, final=True,
                        **self.report(req.engine_rank))
            return
        if hasattr(result, "model_dump_json"):
            yield self._final(req, obs, result.model_dump_json())
            return
        if req.kind == "responses":
            result = _responses_sse(result)
        async for item in self._stream(req, obs, result):
            yield item

    async def _stream(self, req: OpenAIRequest, obs: observed.Observation,
                      events: AsyncIterator[str]) -> AsyncIterator[Reply]:
        parts: list[str] = []
        last_sent: float | None = None
        try:
            async for event in events:
                parts.append(event)
                now = time.monotonic()
                # Everything the first engine output makes (a chat stream's role event and
                # its first token) goes at once: the next output may be a busy engine step
                # away, and the client's time to first token would wait for it.
                # Once the engine is done, the rest (finish, usage, [DONE]) waits for the final
                # item: the router puts its account on the last of those events.
                if not obs.done and (last_sent is None or obs.outputs <= 1
                                     or now - last_sent >= req.stream_interval_s):
                    yield Reply("".join(parts), **(self.report(req.engine_rank)
                                                   if last_sent is None else {}))
                    parts, last_sent = [], now
        finally:
            await events.aclose()  # aborts the engine request if the router went away
        yield self._final(req, obs, "".join(parts))

    def _final(self, req: OpenAIRequest, obs: observed.Observation, data: str) -> Reply:
        reply = Reply(data, final=True, prompt_tokens=obs.prompt_tokens,
                      num_cached_tokens=obs.num_cached_tokens,
                      completion_tokens=obs.completion_tokens, token_ids=obs.token_ids,
                      timings=obs.timings, served_by=self.identity,
                      rendered_by_router=obs.rendered_by_router, **self.report(req.engine_rank))
        t = obs.timings
        if t and req.trace and self.tracing is not None:
            model = req.body.get("model")
            try:
                self.tracing.engine_spans(req.trace, t, {
                    "rayattn.request_id": req.request_id, "rayattn.path": t["path"],
                    "rayattn.replica": str(self.identity.get("engine")),
                    "rayattn.adapter": self._adapter(model),
                    "gen_ai.usage.prompt_tokens": obs.prompt_tokens,
                    "rayattn.cached_tokens": obs.num_cached_tokens,
                    "gen_ai.usage.completion_tokens": obs.completion_tokens}, time.time())
            except Exception:  # tracing must never fail a request
                log.exception("recording the request's spans failed")
        if t and req.log:
            log.info("request %s: %s, prompt %d tokens (%d cached), %d generated, ttft "
                     "%.3fs, e2e %.3fs", req.request_id, t["path"], obs.prompt_tokens,
                     obs.num_cached_tokens, obs.completion_tokens, t["ttft_s"], t["e2e_s"])
        if t and self.metrics is not None:
            model = req.body.get("model")
            try:
                self.metrics.record_request(t["path"], obs.prompt_tokens,
                                            obs.num_cached_tokens, obs.completion_tokens, t,
                                            adapter=self._adapter(model),
                                            rank=(req.engine_rank if self.ranks > 1
                                                  else 0))
            except Exception:  # metrics must never fail a request
                log.exception("recording request metrics failed")
        return reply


async def _responses_sse(events: Any) -> AsyncIterator[str]:
    """vLLM's Responses stream events as `vllm serve` sends them: `event: <type>` then the
    event's JSON."""
    try:
        async for e in events:
            yield (f"event: {getattr(e, 'type', 'unknown')}\n"
                   f"data: {e.model_dump_json(indent=None, by_alias=True)}\n\n")
    finally:
        await events.aclose()


class LazyOpenAILayer:
    """vLLM's OpenAI serving layer over an engine, built on first use (the router's first
    probe): vLLM builds it with async calls, and Serve constructs replicas synchronously."""

    def __init__(self, build: Callable[[], Awaitable[OpenAILayer]]) -> None:
        self._build = build
        self._layer: OpenAILayer | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> OpenAILayer:
        if self._layer is not None:
            return self._layer
        async with self._lock:
            if self._layer is None:
                self._layer = await self._build()
            return self._layer
