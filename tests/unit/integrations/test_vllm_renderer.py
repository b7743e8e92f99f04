"""Pins: vLLM's engine-free renderer as the router builds and calls it
(rayattn/integrations/vllm_renderer.py, rayattn/server/prompts/rendering.py), what the render-once
patch replaces (rayattn/integrations/patches.py), and the transformers tokenizer internals
the router's tokenizer layers read (rayattn/server/prompts/parallel_tokenizing.py)."""

from __future__ import annotations

from rayattn import compat
from tests.unit.integrations import pins

RENDERING = "rayattn/server/prompts/rendering.py"
RENDER_ONCE = "rayattn/integrations/patches.py serve_rendered_prompts (render once)"


def test_the_render_state_is_built_from_a_vllm_config_a_state_and_args():
    init = compat.vllm_attr("init_render_app_state")
    pins.params(init, "vllm_config", "state", "args", leading=True,
                user="rayattn/integrations/vllm_renderer.py render_state")
    pins.source_says(init, r"state\.online_renderer\s*=",
                     user=f"{RENDERING} (state.online_renderer)")
    from vllm.config import VllmConfig

    pins.attrs(VllmConfig, "model_config", "structured_outputs_config",
               user="rayattn/integrations/vllm_renderer.py render_state")
    from vllm.engine.arg_utils import AsyncEngineArgs

    pins.attrs(AsyncEngineArgs, "create_model_config",
               user="rayattn/integrations/vllm_renderer.py render_state")


def test_the_online_renderer_renders_chat_completion_and_responses():
    r = pins.vllm_class("OnlineRenderer")
    # render_responses came after vLLM 0.25: without it the router leaves Responses prompts
    # to the engine (PromptRenderer._render_responses), so it is pinned only where it is.
    methods = ("render_chat", "render_completion",
               *(("render_responses",) if hasattr(r, "render_responses") else ()))
    for method in methods:
        pins.params(getattr(r, method), "request", leading=True,
                    user=f"{RENDERING} PromptRenderer.render")
    pins.source_says(r.__init__, r"self\.renderer\s*=", r"self\.parser\b",
                     user=f"{RENDERING} (PromptRenderer.tokenizer, its parser check)")


def test_the_serving_objects_render_through_their_online_renderer():
    """Render once replaces render_chat / render_completion on the renderer the serving
    objects call: where they stop calling it, the engine would render every body again
    (silently: the patch still reports itself applied)."""
    chat, completion = pins.vllm_class("OpenAIServingChat"), pins.vllm_class(
        "OpenAIServingCompletion")
    for cls, call in ((chat, "render_chat"), (completion, "render_completion")):
        pins.source_says(cls.__init__, r"self\.online_renderer\s*=", user=RENDER_ONCE)
        pins.source_says(cls, rf"self\.online_renderer\.{call}\(", user=RENDER_ONCE)
    pins.source_says(pins.vllm_class("OnlineRenderer").render_chat,
                     r"\) -> tuple\[",
                     user=f"{RENDER_ONCE} (the ([], inputs) it returns for chat)")


def test_a_fast_tokenizer_keeps_its_rust_backend_as_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from rayattn.models.tiny import _tokenizer

    _tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    user = "rayattn/server/prompts/parallel_tokenizing.py install (tokenizer._tokenizer)"
    assert getattr(tok, "_tokenizer", None) is tok.backend_tokenizer, (
        f"{pins.version('transformers')}: {type(tok).__name__}._tokenizer is no longer its "
        f"Rust backend; {user} reads it")
    pins.attrs(tok._tokenizer, "to_str", "encode_batch", user=user)
