"""Pins: vLLM's OpenAI serving layer as rayattn builds and calls it
(rayattn/integrations/vllm_openai.py, rayattn/engine/openai_layer.py), and where this vLLM
keeps its entrypoints (rayattn/compat.py VLLM_LOCATIONS)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from rayattn import compat
from tests.unit.integrations import pins

USER = "rayattn/engine/openai_layer.py"


@pytest.mark.parametrize("name", sorted(compat.VLLM_LOCATIONS))
def test_every_entrypoint_name_is_where_compat_looks(name):
    try:
        compat.vllm_attr(name)
    except ImportError as e:
        pytest.fail(f"{pins.version('vllm')}: {e}; add its new module to "
                    f"rayattn/compat.py VLLM_LOCATIONS")


def test_init_app_state_builds_the_serving_objects_from_engine_state_and_args():
    init = compat.vllm_attr("init_app_state")
    pins.params(init, "engine_client", "state", "args", leading=True,
                user="rayattn/integrations/vllm_openai.py init_openai_state")
    # The extra arguments compat.app_state_kwargs fills are the only others without default.
    required = [p.name for p in list(inspect.signature(init).parameters.values())[3:]
                if p.default is p.empty]
    assert set(required) <= {"supported_tasks", "vllm_config"}, (
        f"{pins.version('vllm')}: init_app_state{inspect.signature(init)} requires "
        f"{required}; rayattn/compat.py app_state_kwargs does not pass them")


def test_frontend_args_are_a_dataclass():
    front = compat.vllm_attr("FrontendArgs")
    assert dataclasses.is_dataclass(front), (
        f"{pins.version('vllm')}: FrontendArgs is no dataclass; "
        "rayattn/integrations/vllm_openai.py frontend_namespace reads its fields")


def test_the_serving_objects_take_the_validated_body_and_the_http_request():
    user = f"{USER} _replies (serving(request, None))"
    for cls, method in (("OpenAIServingChat", "create_chat_completion"),
                        ("OpenAIServingCompletion", "create_completion"),
                        ("OpenAIServingResponses", "create_responses")):
        pins.params(getattr(pins.vllm_class(cls), method), "request", "raw_request",
                    leading=True, user=user)


def test_the_models_object_lists_loads_and_unloads_adapters():
    models = pins.vllm_class("OpenAIServingModels")
    pins.attrs(models, "show_available_models", "load_lora_adapter", "unload_lora_adapter",
               user=f"{USER} (list_models, load_adapter, unload_adapter)")
    pins.params(models.load_lora_adapter, "request", leading=True, user=f"{USER} load_adapter")
    pins.params(models.unload_lora_adapter, "request", leading=True,
                user=f"{USER} unload_adapter")
    pins.source_says(models.__init__, r"self\.lora_requests\b",
                     user=f"{USER} adapters_served (the adapters by name, with lora_path)")


def test_lora_bodies_and_modules_take_what_rayattn_gives():
    pins.attrs(compat.lora_admin_model("load"), "lora_name", "lora_path",
               user=f"{USER} load_adapter")
    pins.attrs(compat.lora_admin_model("unload"), "lora_name", user=f"{USER} unload_adapter")
    pins.attrs(compat.vllm_attr("LoRAModulePath"), "name", "path", "base_model_name",
               user="rayattn/integrations/vllm_openai.py lora_modules")


def test_an_error_response_carries_its_status_code():
    err = compat.openai_model("error")
    pins.attrs(err, "error", user=f"{USER} (the status of vLLM's ErrorResponse)")
    pins.attrs(err.model_fields["error"].annotation, "code",
               user=f"{USER} (the status of vLLM's ErrorResponse)")
