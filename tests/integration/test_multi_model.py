"""Several models behind one router, on real engines (deployments/local-multi.yaml): two
base models with engine deployments of their own, and LoRA adapters on one of them, each
its own `model`, cached apart from the base and the other adapter, kept on the engines that
run it, listed by /v1/models and labelled in the per-path metrics.

Runs last, on an application of its own (tests/own_apps.py) beside the DP-ranks one: deploying
them replaces the shared one (Serve's declarative deploy), whose CPUs their engines take."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.own_apps import MULTI_APP

pytestmark = [pytest.mark.integration, pytest.mark.own_app]
BASE, PIRATE, POET, TINY = "smollm2", "smollm2-pirate", "smollm2-poet", "tiny-llama"
# Long enough for several 32-token blocks.
DOC = ("Routing notes. " + " ".join(f"Replica {i} keeps block {i * 7} of the cache warm."
                                     for i in range(40)))


@pytest.fixture(scope="module")
def multi(own_apps):
    return own_apps[MULTI_APP]


def chat(url: str, model: str, content: str, max_tokens: int = 12,
         system: str | None = None) -> dict:
    messages = [{"role": "user", "content": content}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": model, "max_tokens": max_tokens, "temperature": 0, "messages": messages})
    assert r.status_code == 200, r.text
    return r.json()


def test_models_lists_both_base_models_and_the_adapters(multi):
    from openai import OpenAI

    client = OpenAI(base_url=f"{multi}/v1", api_key="unused", max_retries=0)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {BASE, PIRATE, POET, TINY}
    assert cards[PIRATE].parent == BASE and cards[POET].parent == BASE
    assert cards[TINY].max_model_len == 1024


def test_both_base_models_answer_through_one_endpoint_on_their_own_engines(multi):
    from openai import OpenAI

    client = OpenAI(base_url=f"{multi}/v1", api_key="unused", max_retries=0, timeout=120)
    health = httpx.get(f"{multi}/health", timeout=30).json()
    engines = {name: set(m["engines"]) for name, m in health["models"].items()}
    assert set(engines) == {BASE, TINY} and not engines[BASE] & engines[TINY]
    assert health["models"][BASE]["up"] == 2 and health["models"][TINY]["up"] == 1
    for model in (TINY, BASE, TINY):
        raw = client.chat.completions.with_raw_response.create(
            model=model, max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": "the cache block token"}])
        r = raw.parse()
        assert r.model == model and r.usage.completion_tokens > 0
        assert raw.headers["x-rayattn-replica"] in engines[model]


def test_each_adapter_answers_and_differs_from_the_base(multi):
    from openai import OpenAI

    client = OpenAI(base_url=f"{multi}/v1", api_key="unused", max_retries=0, timeout=120)
    answers = {}
    for model in (BASE, PIRATE, POET):
        r = client.chat.completions.create(
            model=model, max_tokens=12, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert r.model == model
        answers[model] = r.choices[0].message.content
    print(f"\nanswers: {answers}")
    assert len(set(answers.values())) == 3, answers


def test_a_prompt_cached_under_one_adapter_is_not_cached_for_another(multi):
    first = chat(multi, PIRATE, DOC)
    again = chat(multi, PIRATE, DOC)
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= again["usage"]["prompt_tokens"] - 32, again["usage"]
    assert again["rayattn"]["replica"] == first["rayattn"]["replica"]
    assert again["rayattn"]["predicted_cached_tokens"] == cached
    for model in (POET, BASE):
        other = chat(multi, model, DOC)
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, model
        assert other["rayattn"]["predicted_cached_tokens"] == 0, model


def test_an_adapters_requests_stay_on_the_engines_running_it(multi):
    """Prompts that differ from their first token on (the system message), so no cached
    prefix draws them together: only the adapter does. Each engine batch runs one adapter
    (max_loras 1)."""
    def replica(model: str, i: int) -> str:
        ext = chat(multi, model, "Name a colour.", max_tokens=4,
                   system=f"{i} {model} asks.")["rayattn"]
        return ext["replica"]

    where = {model: {replica(model, i) for i in range(6)} for model in (PIRATE, POET)}
    print(f"\nreplicas per adapter: {where}")
    assert len(where[PIRATE]) == 1 and len(where[POET]) == 1, where
    # The control: the base model's requests of the same shape spread over both engines.
    base = {replica(BASE, i) for i in range(10)}
    assert len(base) == 2, base


def test_an_unknown_adapter_is_vllms_404_naming_the_model(multi):
    r = httpx.post(f"{multi}/v1/chat/completions", timeout=30, json={
        "model": "smollm2-unknown", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["param"] == "model" and "smollm2-unknown" in err["message"]


def test_per_path_metrics_carry_the_adapter(multi, ray_cluster):
    chat(multi, POET, "Count to three.")
    url = f"http://127.0.0.1:{ray_cluster['metrics_port']}/metrics"
    pattern = re.compile(r'^ray_rayattn_requests_total\{[^}]*adapter="([^"]*)"', re.M)
    deadline = time.time() + 30
    while True:
        seen = set(pattern.findall(httpx.get(url, timeout=10).text))
        if {PIRATE, POET} <= seen or time.time() > deadline:
            break
        time.sleep(1)
    assert {PIRATE, POET} <= seen, seen


def test_responses_continue_a_conversation_on_the_engine_that_stored_it(multi):
    """/v1/responses through vLLM's own serving layer: each turn names the previous one by
    `previous_response_id`, whose stored history only its engine holds; the router sends it
    there, where the history is also cached (the second turn streamed)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{multi}/v1", api_key="unused", max_retries=0, timeout=120)
    prev, replicas, cached = None, [], []
    for turn, text in enumerate([DOC, "Which replica keeps block 14?", "And block 21?"]):
        kw = dict(model=BASE, input=text, max_output_tokens=8, temperature=0,
                  previous_response_id=prev)
        if turn == 1:
            raw = client.responses.with_raw_response.create(stream=True, **kw)
            events = list(raw.parse())
            done = [e for e in events if e.type == "response.completed"]
            assert len(done) == 1, [e.type for e in events]
            r = done[0].response
        else:
            raw = client.responses.with_raw_response.create(**kw)
            r = raw.parse()
        # "incomplete" where max_output_tokens cut the answer short
        assert r.status in ("completed", "incomplete") and r.output_text, r
        replicas.append(raw.headers["x-rayattn-replica"])
        cached.append(r.usage.input_tokens_details.cached_tokens)
        prev = r.id
    print(f"\nresponses: replicas {replicas}, cached tokens {cached}")
    assert len(set(replicas)) == 1
    assert cached[1] > 0 and cached[2] > cached[1], cached


def test_an_unknown_previous_response_is_a_404_naming_the_field(multi):
    r = httpx.post(f"{multi}/v1/responses", timeout=30, json={
        "model": BASE, "input": "hi", "previous_response_id": "resp_nope"})
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert "resp_nope" in err["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_one_trace_follows_a_request_through_router_and_engine(multi, otlp, stream):
    trace_id = ("4bf92f3577b34da6a3ce929d0e0e4736" if stream
                else "0af7651916cd43dd8448eb211c80319c")
    client_span = "00f067aa0ba902b7"
    r = httpx.post(f"{multi}/v1/chat/completions", timeout=120, headers={
        "traceparent": f"00-{trace_id}-{client_span}-01", "x-request-id": f"traced-{stream}"},
        json={"model": POET, "max_tokens": 6, "stream": stream,
              "messages": [{"role": "user", "content": "Trace me."}]})
    assert r.status_code == 200, r.text
    assert r.headers["traceparent"].split("-")[1] == trace_id
    want = {"rayattn.request", "rayattn.route", "rayattn.engine", "queue", "decode"}
    deadline = time.time() + 30
    while not want <= set(spans := otlp.trace(trace_id)) and time.time() < deadline:
        time.sleep(0.5)
    print(f"\nspans of trace {trace_id}: {sorted(spans)}")
    assert want <= set(spans)
    assert {"prefill", "extend"} & set(spans)
    req, route, engine = spans["rayattn.request"], spans["rayattn.route"], spans["rayattn.engine"]
    assert req.parent_span_id.hex() == client_span
    assert route.parent_span_id == engine.parent_span_id == req.span_id
    assert spans["queue"].parent_span_id == spans["decode"].parent_span_id == engine.span_id
    attrs = {a.key: a.value.string_value for a in engine.attributes}
    assert attrs["rayattn.request_id"] == f"traced-{stream}"
    assert attrs["rayattn.adapter"] == POET
    # The router's own hop ends before the engine's span does.
    assert route.end_time_unix_nano <= engine.end_time_unix_nano <= req.end_time_unix_nano


def test_an_adapter_loaded_at_run_time_is_served_on_every_engine_until_unloaded(multi):
    """vLLM's /v1/load_lora_adapter through the router: every engine of the model loads it,
    /v1/models lists it, requests for it answer (unlike the base), and after
    /v1/unload_lora_adapter it is vLLM's 404 again."""
    from rayattn.models.embedded import resolve_embedded
    from rayattn.models.lora import resolve_adapter

    path = resolve_adapter("rayattn://random-lora/3",
                           resolve_embedded("rayattn://smollm2-135m"), prepare=True)
    sage = "smollm2-sage"
    bad = [({"lora_name": sage}, "lora_path"), ({"lora_name": TINY, "lora_path": path},
                                                "lora_name")]
    for body, field in bad:
        r = httpx.post(f"{multi}/v1/load_lora_adapter", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = httpx.post(f"{multi}/v1/load_lora_adapter", timeout=120,
                   json={"lora_name": sage, "lora_path": path})
    assert r.status_code == 200, r.text
    assert sage in {m["id"] for m in httpx.get(f"{multi}/v1/models", timeout=30)
                    .json()["data"]}
    health = httpx.get(f"{multi}/health", timeout=30).json()
    engines = set(health["models"][BASE]["engines"])
    assert all(sage in health["engines"][e]["adapters"] for e in engines), health["engines"]
    q = "What is the capital of France?"
    served = {chat(multi, sage, q, system=f"{i}")["rayattn"]["replica"] for i in range(4)}
    assert served <= engines
    assert chat(multi, sage, q)["choices"][0]["message"]["content"] != \
        chat(multi, BASE, q)["choices"][0]["message"]["content"]
    r = httpx.post(f"{multi}/v1/unload_lora_adapter", json={"lora_name": sage}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{multi}/v1/chat/completions", timeout=60, json={
        "model": sage, "messages": [{"role": "user", "content": q}]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
