"""vLLM's OpenAI serving layer over one engine: the objects `vllm serve` builds
(init_app_state: chat, completion, responses, models), from the engine's and the frontend's
arguments, and the LoRA modules it serves from the start. Where this vLLM keeps them and what
its functions take: rayattn/compat.py."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from rayattn import compat
from rayattn.integrations.vllm_engine import engine_args


def frontend_namespace(engine_kwargs: dict[str, Any], frontend: dict[str, Any],
                       vllm_config: Any) -> Any:
    """The argparse Namespace `vllm serve` would hand vLLM's init_app_state: the engine's
    arguments plus the frontend's (chat template, parsers), with the structured-outputs
    config the engine resolved (it carries the reasoning parser init_app_state reads)."""
    front_cls = compat.vllm_attr("FrontendArgs")
    known = {f.name for f in dataclasses.fields(front_cls)}
    ns = argparse.Namespace(**{**vars(front_cls(**{k: v for k, v in frontend.items()
                                                    if k in known})),
                               **vars(engine_args(engine_kwargs))})
    ns.structured_outputs_config = vllm_config.structured_outputs_config
    for k, v in frontend.items():
        setattr(ns, k, v)
    return ns


async def init_openai_state(engine_client: Any, args: Any) -> Any:
    """vLLM's own OpenAI serving objects over `engine_client`, as `vllm serve` builds them
    (state.openai_serving_chat, openai_serving_completion, openai_serving_models)."""
    from starlette.datastructures import State

    init = compat.vllm_attr("init_app_state")
    state = State()
    kw = await compat.app_state_kwargs(init, engine_client)
    await init(engine_client, state, args, **kw)
    return state


def lora_modules(adapters: dict[str, str], base: str) -> list[Any]:
    """vLLM's static LoRA modules (`vllm serve --lora-modules`) for the serving layer."""
    cls = compat.vllm_attr("LoRAModulePath")
    return [cls(name=n, path=p, base_model_name=base) for n, p in adapters.items()]
