"""vLLM's engine-free renderer (what `vllm launch render` serves), for the router: the engines'
chat template, tokenizer and parsers without an engine or a GPU, and the token ids of what it
renders. The engine side's use of it (render once) is a run-time patch: patches.py."""

from __future__ import annotations

from typing import Any

from rayattn import compat
from rayattn.integrations.vllm_engine import engine_args
from rayattn.integrations.vllm_openai import frontend_namespace


async def render_state(engine_kwargs: dict[str, Any], frontend: dict[str, Any]) -> Any:
    """vLLM's engine-free renderer, configured as the engines' serving layer is. Returns the
    state whose `online_renderer` renders chat and completion requests."""
    from starlette.datastructures import State
    from vllm.config import VllmConfig

    init = compat.vllm_attr("init_render_app_state")
    args_ = engine_args(engine_kwargs)
    model_config = args_.create_model_config()
    # Rendering needs no kernels: no quantization checks against this process's device.
    model_config.quantization = None
    vllm_config = VllmConfig(model_config=model_config, **compat.render_config_kwargs(args_))
    args = frontend_namespace(engine_kwargs, frontend, vllm_config)
    state = State()
    await init(vllm_config, state, args)
    return state


def prompt_token_ids(engine_input: Any) -> list[int]:
    """The token ids of one rendered prompt (vLLM's EngineInput / TokensPrompt)."""
    ids = engine_input.get("prompt_token_ids") if isinstance(engine_input, dict) \
        else getattr(engine_input, "prompt_token_ids", None)
    return ids or []
