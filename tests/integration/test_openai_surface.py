"""The OpenAI surface vLLM serves, through rayattn, with the official `openai` client.

The shared SmolLM2 deployment covers sampling and output options; a second application
serves a tiny model whose tokenizer has Qwen3's <think> / <tool_call> markers, with vLLM's
qwen3 reasoning parser, hermes tool-call parser and a chat template from a file (the
model.* settings), so reasoning, tools and chat_template_kwargs run on real engines.
Structured outputs force the tiny model's random weights into the exact text the parsers
must take apart (with `enable_in_reasoning`, the grammar also covers the thinking part).
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from rayattn.bench.cli import wait_healthy

pytestmark = pytest.mark.integration
MODEL = "smollm2"
Q = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


# ---- the shared SmolLM2 deployment ---------------------------------------------------------
def test_response_format_json_schema_output_validates(client):
    schema = {"type": "object",
              "properties": {"capital": {"type": "string", "enum": ["Paris", "Lyon", "Rome"]},
                             "country": {"type": "string", "maxLength": 12}},
              "required": ["capital", "country"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=Q, max_tokens=200, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": schema}})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text
    out = json.loads(text)
    jsonschema.validate(out, schema)


def test_logprobs_and_top_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for tok in content:
        assert len(tok.top_logprobs) == 3 and tok.logprob <= 0
        # Greedy: the chosen token is the most likely one.
        assert tok.logprob == pytest.approx(max(t.logprob for t in tok.top_logprobs))


def test_n_two_choices_and_usage_counts_both(client):
    r = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=6, temperature=1.0,
                                       n=2, seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content for c in r.choices)
    assert r.usage.completion_tokens == 12


def test_stop_string_ends_the_answer(client):
    full = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=12,
                                          temperature=0).choices[0].message.content
    assert "Paris" in full
    r = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=12, temperature=0,
                                       stop=["Paris"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full.split("Paris")[0]


def test_seed_reproduces_sampling_and_top_k_min_p_through_extra_body(client):
    def sample(**kw) -> str:
        return client.chat.completions.create(model=MODEL, messages=Q, max_tokens=10,
                                              **kw).choices[0].message.content

    hot = dict(temperature=1.5)
    assert sample(seed=11, **hot) == sample(seed=11, **hot)
    assert len({sample(seed=s, **hot) for s in (1, 2, 3, 4)}) > 1  # sampling does sample
    greedy = sample(temperature=0)
    # Keeping only the most likely token (top_k=1, or min_p=1) is greedy whatever the
    # temperature: proof that vLLM received the extra sampling parameters.
    assert sample(seed=5, extra_body={"top_k": 1}, **hot) == greedy
    assert sample(seed=6, extra_body={"min_p": 1.0}, **hot) == greedy


def test_streaming_carries_usage_and_cached_tokens(client):
    long_q = [{"role": "system", "content": "You answer geography questions. " * 60}] + Q
    for _ in range(2):
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=long_q, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage.prompt_tokens > 300, usage
    # The second identical request reuses the first's KV blocks on the same replica.
    assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 64
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_completions_with_echo_and_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is",
                                  max_tokens=3, temperature=0, echo=True, logprobs=2)
    assert r.choices[0].text.startswith("The capital of France is")
    assert len(r.choices[0].logprobs.top_logprobs) >= 3


def test_models_is_vllms_list(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == 2048


# ---- a tiny model with reasoning and tool-call parsers --------------------------------------
@pytest.fixture(scope="module")
def chat_app(ray_cluster, server, tmp_path_factory):
    from ray import serve

    from rayattn.app import build_app
    from rayattn.models.tiny import _CHAT_TEMPLATE, make_tiny_model

    d = tmp_path_factory.mktemp("tinychat")
    path = make_tiny_model("llama", d / "model")
    template = d / "template.jinja"
    template.write_text(_CHAT_TEMPLATE)
    args = {
        "model": {"source": str(path), "served_name": "tiny-chat", "max_model_len": 1024,
                  "reasoning_parser": "qwen3", "tool_call_parser": "hermes",
                  "chat_template": str(template)},
        "platform": {"kind": "cpu", "cpus_per_engine": 0.5},
        "attention": {"block_size": 32},
        "engine": {"kv_cache_memory_bytes": 64 * 2**20, "max_num_seqs": 8,
                   "extra_engine_kwargs": {"structured_outputs_config":
                                           {"enable_in_reasoning": True}}},
    }
    serve.run(build_app(args), name="chat", route_prefix="/chat", blocking=False)
    url = f"{server}/chat"
    wait_healthy(url, timeout=600)
    yield url, args
    serve.delete("chat", _blocking=False)  # nothing of it is needed again


@pytest.fixture(scope="module")
def chat_client(chat_app):
    from openai import OpenAI

    return OpenAI(base_url=f"{chat_app[0]}/v1", api_key="unused", max_retries=0, timeout=120)


def _forced(text: str) -> dict:
    """Structured outputs forcing exactly `text`."""
    return {"structured_outputs": {"regex": re.escape(text)}}


def test_reasoning_parser_splits_thinking_from_content(chat_client):
    r = chat_client.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "the capital"}],
        max_tokens=100, temperature=0,
        extra_body=_forced("<think>the cache block</think>paris"))
    msg = r.choices[0].message
    thinking = msg.model_extra.get("reasoning") or msg.model_extra.get("reasoning_content")
    assert thinking == "the cache block"
    assert msg.content == "paris"


def test_tools_rendered_and_tool_call_parsed(chat_client):
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "paris"}}</tool_call>'
    r = chat_client.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "weather in paris"}],
        tools=[WEATHER], tool_choice="auto", max_tokens=200, temperature=0,
        extra_body=_forced(call))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (tc,) = choice.message.tool_calls
    assert tc.function.name == "get_weather"
    assert json.loads(tc.function.arguments) == {"city": "paris"}


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_router_renders_exactly_the_engines_prompt(chat_app, chat_client, kwargs):
    """The router's block hashes are the engine's: vLLM's renderer in the router gives the
    token ids the engine's serving layer rendered, with tools and chat_template_kwargs."""
    from rayattn.config.loader import parse_args
    from rayattn.config.plan import build_plan
    from rayattn.server.prompts.rendering import PromptRenderer

    url, args = chat_app
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "weather?"}],
            "tools": [WEATHER], "max_tokens": 2, "temperature": 0,
            "chat_template_kwargs": kwargs}
    r = chat_client.chat.completions.create(
        **{k: v for k, v in body.items() if k != "chat_template_kwargs"},
        extra_body={"return_token_ids": True, "chat_template_kwargs": kwargs})
    engine_ids = r.model_extra["prompt_token_ids"]

    cfg = parse_args(args)
    renderer = asyncio.run(PromptRenderer.create(cfg, build_plan(cfg).engine_kwargs))
    from rayattn import compat

    request = compat.openai_model("chat").model_validate(body)
    router_ids = asyncio.run(renderer.render("chat", request)).token_ids
    assert router_ids == engine_ids
    text = renderer.tokenizer.decode(router_ids)
    assert '"get_weather"' in text  # tools are in the prompt
    assert ("</think>" in text) == (kwargs.get("enable_thinking") is False)
