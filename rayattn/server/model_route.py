"""One base model behind the router: its engines (a Dispatcher over its engine deployment),
vLLM's renderer for its prompts, and the `model` names it answers to (the base and its
LoRA adapters). The ingress keeps one per base model and picks it by the request's `model`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from rayattn import compat
from rayattn.config.plan import build_plan
from rayattn.config.schema import RayAttnConfig
from rayattn.engine.protocol import Reply
from rayattn.server.dispatch import Dispatcher
from rayattn.server.errors import PROMPT_FIELD, APIError, client_error, error_response
from rayattn.server.prompts.rendering import PromptRenderer, Rendered
from rayattn.server.tenancy.gates import Gates

log = logging.getLogger("rayattn.ingress")


class ModelRoute:
    def __init__(self, cfg: RayAttnConfig, engines: Any, gates: Gates | None = None) -> None:
        """`gates`: the router's admission and fairness, shared by all its models."""
        plan = build_plan(cfg, prepare_model=True)
        self.cfg = cfg
        self.name = cfg.model.name
        self.engine_kwargs = plan.engine_kwargs
        self.dispatcher = Dispatcher(cfg, plan.block_size, engines, adapters=plan.adapters,
                                     gates=gates)
        self._renderer_building: asyncio.Task[PromptRenderer] | None = None
        self._renderer_built: PromptRenderer | None = None  # once the task is done
        self._models: list[dict[str, Any]] | None = None

    def adapter(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model): configured,
        or loaded at run time on some of this model's engines."""
        return model if self.dispatcher.adapters.knows(model) else None

    async def load_adapter(self, name: str, path: str) -> Reply:
        """vLLM's run-time load on every live engine of this model; where one refuses, the
        others unload it again, and the answer is that refusal."""
        d = self.dispatcher
        members = [d.fleet.members[n] for n in d.live()]
        if not members:
            raise self.not_ready()
        replies = await asyncio.gather(*(r.handle.load_adapter.remote(name, path)
                                         for r in members))
        failed = next((rep for rep in replies if rep.status != 200), None)
        if failed is not None:
            fresh = not d.adapters.knows(name)
            await asyncio.gather(*(r.handle.unload_adapter.remote(name)
                                   for r, rep in zip(members, replies, strict=True)
                                   if rep.status == 200 and fresh))
            return failed
        d.adapters.loaded(name, path, members)
        self._models = None
        return replies[0]

    async def unload_adapter(self, name: str) -> Reply:
        d = self.dispatcher
        members = [d.fleet.members[n] for n in d.fleet.serving(name)]
        d.adapters.runtime.pop(name, None)  # nor loaded on replicas that start later
        if not members:
            raise APIError(404, f"The LoRA adapter `{name}` is not loaded.",
                           param="lora_name")
        replies = await asyncio.gather(*(r.handle.unload_adapter.remote(name)
                                         for r in members))
        d.adapters.unloaded(name, members)
        self._models = None
        return next((rep for rep in replies if rep.status != 200), replies[0])

    async def start(self) -> None:
        """The fleet view, and vLLM's renderer built in the background from the first call
        (a health probe, usually) so that no request waits for it."""
        await self.dispatcher.start()
        if self._renderer_building is None:
            self._renderer_building = asyncio.get_running_loop().create_task(
                PromptRenderer.create(self.cfg, self.engine_kwargs))

    async def renderer(self) -> PromptRenderer:
        if self._renderer_built is not None:
            return self._renderer_built
        await self.start()
        task = self._renderer_building
        assert task is not None
        try:
            self._renderer_built = await asyncio.shield(task)
            return self._renderer_built
        except Exception as e:  # e.g. the tokenizer not loadable here: retried next request
            log.error("vLLM's renderer could not be built: %r", e)
            if self._renderer_building is task:
                self._renderer_building = None
            raise APIError(503, "the router cannot render prompts yet: "
                                f"{type(e).__name__}: {str(e)[:200]}", retry_after=5) from None

    def render_counts(self) -> dict[str, float]:
        """Prompt tokens the renderer tokenized (of those, tokenized in pieces on several
        cores), and those it reused from earlier prompts' heads
        (rayattn/server/incremental_tokenizer.py, parallel_tokenizing.py)."""
        inc = self._renderer_built.incremental if self._renderer_built else None
        return {} if inc is None else {"tokens_tokenized": inc.tokenized_tokens,
                                       "tokens_pieced": inc.pieced_tokens,
                                       "tokens_reused": inc.reused_tokens}

    async def render(self, kind: str, body: Any) -> Rendered:
        renderer = await self.renderer()
        try:
            out = await renderer.render(kind, body)
        except compat.client_error_types() as e:  # vLLM's: prompt too long, bad template…
            raise client_error(e, PROMPT_FIELD[kind]) from None
        except Exception as e:
            raise render_failure(e, PROMPT_FIELD[kind]) from None
        if not isinstance(out, Rendered):
            raise error_response(out)
        if not out.token_ids and kind != "responses":  # a continuation is not rendered
            raise APIError(400, "the prompt is empty", param="prompt")
        return out

    async def models(self) -> list[dict[str, Any]] | None:
        """vLLM's own model cards (names, max_model_len, adapters with their parent), the
        same on every engine; None while no engine serves."""
        if self._models is None:
            live = self.dispatcher.live()
            if not live:
                return None
            handle = self.dispatcher.fleet.members[live[0]].handle
            self._models = (await handle.models.remote())["data"]
        return self._models

    def not_ready(self) -> APIError:
        n = len(self.dispatcher.fleet.members)
        return APIError(503, f"not ready: 0 of {n} engine replicas of {self.name} serve yet "
                             "(engines load the model at start-up; retry shortly)",
                        retry_after=5)


def render_failure(e: Exception, param: str) -> APIError:
    """What a rendering error is for the client. The errors malformed messages raise inside
    the chat template and vLLM's parsers are the client's (400); anything else is the
    router's own failure (500), named by type only: its message may describe internals."""
    # jinja2 comes with vLLM (the chat templates): not a dependency of the router module.
    from jinja2 import TemplateError

    if isinstance(e, (ValueError, TypeError, LookupError, AttributeError, RecursionError,
                      TemplateError)):
        return APIError(400, f"the prompt could not be rendered: {type(e).__name__}: "
                             f"{str(e)[:300]}", param=param)
    log.exception("rendering failed")
    return APIError(500, f"internal error while rendering the prompt ({type(e).__name__})")
