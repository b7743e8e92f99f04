"""Several models behind one router, on real engines (deployments/local-multi.yaml): two
base models with engine deployments of their own, and LoRA adapters on one of them, each
its own `model`, cached apart from the base and the other adapter, kept on the engines that
run it, listed by /v1/models and labelled in the per-path metrics.

Runs last, on an application of its own: deploying it replaces the shared one (Serve's
declarative deploy), whose CPUs its two engines take."""

from __future__ import annotations

import re
import time

import httpx
import pytest
import yaml

from tests.conftest import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.own_app]
BASE, PIRATE, POET, TINY = "smollm2", "smollm2-pirate", "smollm2-poet", "tiny-llama"
# Long enough for several 32-token blocks.
DOC = ("Routing notes. " + " ".join(f"Replica {i} keeps block {i * 7} of the cache warm."
                                     for i in range(40)))


@pytest.fixture(scope="module")
def multi(ray_cluster):
    from rayattn.app import deploy_config, wait_running
    from rayattn.bench.cli import wait_healthy

    cfg = yaml.safe_load((ROOT / "deployments" / "local-multi.yaml").read_text())
    t0 = time.time()
    deploy_config(cfg)
    wait_running("rayattn-multi")
    url = f"http://127.0.0.1:{ray_cluster['http_port']}"
    wait_healthy(url)
    print(f"\nlocal-multi deployment ready in {time.time() - t0:.1f}s")
    return url


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
        assert r.status == "completed" and r.output_text is not None
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
