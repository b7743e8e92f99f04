"""The router's prompt rendering: vLLM's own renderer, configured as the engines' serving
layer is (same chat template, tokenizer, parsers, frontend settings), so the token ids the
router hashes into KV blocks are the ones the engine will cache.

Render once: the engine serves the router's rendering (`Rendered.engine_inputs`) instead of
rendering the body again, when nothing but token ids is needed from it: a text prompt, no
echo (vLLM echoes from its own rendering), and no tool or reasoning parser (vLLM's parsers
adjust the request while rendering it). Other requests are rendered again by the engine;
tests/integration/test_openai_surface.py checks that both give the same ids (tools and
chat_template_kwargs included)."""

from __future__ import annotations

import asyncio
from typing import Any

from rayattn import compat
from rayattn.config.plan import frontend_kwargs
from rayattn.config.schema import RayAttnConfig
from rayattn.integrations import patches
from rayattn.integrations.vllm_renderer import prompt_token_ids, render_state
from rayattn.server.prompts import incremental_tokenizer
from rayattn.server.prompts.parallel_tokenizing import process_cores


class Rendered:
    def __init__(self, token_ids: list[int], text: str,
                 engine_inputs: list[dict[str, Any]] | None = None) -> None:
        self.token_ids = token_ids
        self.text = text
        """The prompt's text as the client sent it (ray_prefix routes on characters)."""
        self.engine_inputs = engine_inputs
        """What the engine may serve as it is (None: the engine renders the body itself)."""


# What a plain tokens prompt holds. The router's arrival time is left out: the engine
# stamps its own (its clock, its queue).
_TOKEN_INPUT_KEYS = frozenset({"type", "prompt_token_ids", "prompt", "cache_salt",
                               "arrival_time"})


def _reusable(inputs: list[Any]) -> list[dict[str, Any]] | None:
    if len(inputs) != 1:
        return None
    (one,) = inputs
    if not isinstance(one, dict) or one.get("type") != "token" or not set(one) <= \
            _TOKEN_INPUT_KEYS:
        return None  # multimodal, embeddings, encoder-decoder: the engine renders those
    return [{k: v for k, v in one.items() if k != "arrival_time"}]


class PromptRenderer:
    def __init__(self, renderer: Any) -> None:
        self._vllm = renderer
        # vLLM's parsers adjust a chat request while rendering it (tool grammars, reasoning):
        # the engine must then render it itself, to have its own request adjusted.
        self._chat_reusable = getattr(renderer, "parser", "unknown") is None
        self.incremental = incremental_tokenizer.install(self.tokenizer)
        """Tokens reused from earlier prompts' heads and tokens tokenized (None: off)."""

    @classmethod
    async def create(cls, cfg: RayAttnConfig, engine_kwargs: dict[str, Any]) -> PromptRenderer:
        threads = cfg.serve.router_render_threads or min(4, process_cores())
        state = await render_state({**engine_kwargs, **compat.renderer_threads(threads)},
                                   frontend_kwargs(cfg))
        # Off the event loop: installing the tokenizer layers self-tests them (~0.5 s).
        renderer = await asyncio.to_thread(cls, state.online_renderer)
        patches.log_applied(f"router, renderer of {cfg.model.name}",
                            [patches.INCREMENTAL_TOKENIZER]
                            if renderer.incremental is not None else [])
        return renderer

    @property
    def tokenizer(self) -> Any:
        return self._vllm.renderer.tokenizer

    async def render(self, kind: str, request: Any) -> Rendered | Any:
        """The prompt of a validated chat or completion request, or vLLM's ErrorResponse
        (the client's error: unknown tool choice, template error, prompt too long, …).
        A completion with several prompts routes on its first."""
        if kind == "chat":
            out = await self._vllm.render_chat(request)
            if isinstance(out, compat.openai_model("error")):
                return out
            _, inputs = out
            text = "\n".join(_text(m.get("content")) for m in request.messages
                             if isinstance(m, dict))
            reusable = self._chat_reusable and not request.echo
        elif kind == "responses":
            return await self._render_responses(request)
        else:
            inputs = await self._vllm.render_completion(request)
            if isinstance(inputs, compat.openai_model("error")):
                return inputs
            p = request.prompt
            text = p if isinstance(p, str) else (p[0] if p and isinstance(p[0], str) else "")
            reusable = not request.echo
        return Rendered(prompt_token_ids(inputs[0]) if inputs else [], text,
                        _reusable(inputs) if reusable else None)


    async def _render_responses(self, request: Any) -> Rendered | Any:
        """A Responses request's prompt, for routing only: the engine renders it again with
        the conversation it stored. A continuation (`previous_response_id`) is not rendered
        here (its history is in one engine's memory, where the router pins it), nor is
        anything where the installed vLLM's renderer has no Responses rendering."""
        render = getattr(self._vllm, "render_responses", None)
        if request.previous_response_id is not None or render is None:
            return Rendered([], "", None)
        out = await render(request)
        if isinstance(out, compat.openai_model("error")):
            return out
        text = request.input if isinstance(request.input, str) else ""
        return Rendered(prompt_token_ids(out.engine_input), text, None)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""
