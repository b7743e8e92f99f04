"""Simulated engines (engine.simulated) behind the real router, as the capacity benchmark
runs them (bench/router_capacity.py): Serve deploys them in place of vLLM engines, the router
probes them, follows their KV events over the relays and calls them over the direct
transport, and a conversation's next turn goes where its history is cached and finds it there.
Serve autoscales them with rayattn's policy on their KV usage (tests/own_apps.py
SIM_AUTOSCALING): a third engine under long prompts, back to two when they stop.

Runs on an application of its own (tests/own_apps.py), deployed beside the multi-model and
DP-ranks ones."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.own_apps import SIM_APP, SIM_AUTOSCALING, SIMULATED

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


def _wait(what: str, check, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
    return got


def test_serve_adds_an_engine_on_kv_usage_and_removes_it_when_the_load_goes(sim):
    """Requests in flight stay far under their target (1000 per engine); the KV the long
    prompts hold is over its target (1 %): the engines report it, rayattn's policy asks for
    a third, which serves; with the load gone there is no KV held, no latency, and the fleet
    is back at its minimum. Not one request fails."""
    lo, hi = SIM_AUTOSCALING["min_replicas"], SIM_AUTOSCALING["max_replicas"]
    before = _wait(f"{lo} engines up", lambda: (h := _health(sim))["replicas"] == lo
                   and len(h["replicas_up"]) == lo and h, 60)
    done: list[tuple[int, str | None]] = []
    stop = threading.Event()

    def stream(i: int) -> None:
        with httpx.Client(timeout=60) as c:
            n = 0
            while not stop.is_set():
                n += 1
                # ~1,500 tokens of its own (its first block differs): ~47 blocks held
                # while it runs, above the target.
                doc = f"Request {i}.{n}: " + "river mountain valley forest ocean " * 280
                r = c.post(f"{sim}/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 8,
                    "messages": [{"role": "user", "content": doc}]},
                    headers={"x-session-id": f"kv-{i}-{n}"})
                done.append((r.status_code, r.headers.get("x-rayattn-replica")))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    try:
        def added() -> list[str]:
            failed = [code for code, _ in done if code != 200]
            assert not failed, failed[:5]
            return [n for n in _health(sim)["replicas_up"] if n not in before["replicas_up"]]

        up = _wait(f"engine {hi} of {hi}", added, 120)
        _wait("requests on the new engine", lambda: any(r == up[0] for _, r in done), 30)
    finally:
        stop.set()
        for t in threads:
            t.join()
    _wait(f"back to {lo} engines", lambda: (h := _health(sim))["replicas"] == lo
          and len(h["replicas_up"]) == lo, 120)
    codes = [code for code, _ in done]
    assert codes and codes.count(200) == len(codes), codes
