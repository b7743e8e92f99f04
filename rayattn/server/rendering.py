"""The router's prompt rendering: vLLM's own renderer, configured as the engines' serving
layer is (same chat template, tokenizer, parsers, frontend settings), so the token ids the
router hashes into KV blocks are the ones the engine will cache. The engine renders the
request again in its serving layer; tests/integration/test_openai_surface.py checks that both
give the same ids (tools and chat_template_kwargs included)."""

from __future__ import annotations

from typing import Any

from rayattn import compat
from rayattn.config.plan import frontend_kwargs
from rayattn.config.schema import RayAttnConfig


class Rendered:
    def __init__(self, token_ids: list[int], text: str) -> None:
        self.token_ids = token_ids
        self.text = text
        """The prompt's text as the client sent it (ray_prefix routes on characters)."""


class PromptRenderer:
    def __init__(self, renderer: Any) -> None:
        self._vllm = renderer

    @classmethod
    async def create(cls, cfg: RayAttnConfig, engine_kwargs: dict[str, Any]) -> PromptRenderer:
        state = await compat.render_state(engine_kwargs, frontend_kwargs(cfg))
        return cls(state.online_renderer)

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
        else:
            inputs = await self._vllm.render_completion(request)
            if isinstance(inputs, compat.openai_model("error")):
                return inputs
            p = request.prompt
            text = p if isinstance(p, str) else (p[0] if p and isinstance(p[0], str) else "")
        return Rendered(compat.prompt_token_ids(inputs[0]) if inputs else [], text)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""
