"""Simulated engines (engine.simulated) behind the real router, as the capacity benchmark
runs them (bench/router_capacity.py): Serve deploys them in place of vLLM engines, the router
probes them, follows their KV events over the relays and calls them over the direct
transport, and a conversation's next turn goes where its history is cached and finds it there.

Runs on an application of its own (tests/own_apps.py), deployed beside the multi-model and
DP-ranks ones."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.own_apps import SIM_APP, SIMULATED

pytestmark = [pytest.mark.integration, pytest.mark.own_app]
MODEL = "smollm2"


@pytest.fixture(scope="module")
def sim(own_apps):
    return own_apps[SIM_APP]


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=30).json()


def test_a_conversation_continues_where_its_history_is_cached(sim):
    from openai import OpenAI

    engines = _health(sim)["engines"]
    assert len(engines) == 2
    assert {e["backend"] for e in engines.values()} == {"SIMULATED"}
    assert {e["kv_blocks"] for e in engines.values()} == {SIMULATED["num_blocks"]}
    client = OpenAI(base_url=f"{sim}/v1", api_key="unused", max_retries=0, timeout=60)
    doc = "river mountain valley forest ocean " * 120  # ~600 tokens: many full blocks
    messages = [{"role": "user", "content": f"{doc}\nWhat is this about?"}]
    headers = {"x-session-id": "sim-conversation"}
    first = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=4, extra_headers=headers)
    answer = first.parse()
    assert answer.choices[0].message.content == " the" * 4
    assert answer.usage.prompt_tokens_details.cached_tokens == 0
    replica = first.headers["x-rayattn-replica"]
    # The engine's KV events reach the router's view of its cache.
    deadline = time.monotonic() + 30
    while not _health(sim)["engines"][replica]["cache_view"]["blocks"]:
        assert time.monotonic() < deadline, "the router never saw the engine's stored blocks"
        time.sleep(0.2)
    messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                 {"role": "user", "content": "And in one word?"}]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, stream=True,
        stream_options={"include_usage": True}, extra_headers=headers)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    ext = chunks[-1].model_extra["rayattn"]
    assert text == " the" * 4
    # Routed to the engine holding the history, predicted from its events, and served
    # there from its cache (all but the new question and the last partial block).
    assert ext["replica"] == replica and ext["path"] == "extend"
    assert ext["predicted_cached_tokens"] > 0
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached >= answer.usage.prompt_tokens - 32, (cached, usage)
