"""The main job end to end: real Ray Serve, real vLLM CPU engines, the official openai client."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.integration
MODEL = "smollm2"


def test_chat_completion_paris(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=20)
    assert "Paris" in r.choices[0].message.content
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0


def test_cached_tokens_are_exact(client):
    """A never-seen prompt reports 0 cached tokens; the same prompt again reports every full
    block but the last token's (vLLM always computes at least one token)."""
    import uuid

    block = 32
    msgs = [{"role": "user", "content": f"{uuid.uuid4().hex} " + "tell me a story " * 20}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                           temperature=0)
    second = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                            temperature=0)
    p = first.usage.prompt_tokens
    assert p > 3 * block
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (p - 1) // block * block


def test_engine_serves_the_routers_rendering_once(client):
    """A plain chat is rendered once, by the router, and the engine serves those token ids;
    an echo needs the engine's own rendering. Both answer the same question the same way,
    and the router reports the way to the first token leg by leg."""
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                           max_tokens=12)
    echo = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                          max_tokens=12, extra_body={"echo": True})
    assert plain.model_extra["rayattn"]["rendered_by_router"] is True
    assert echo.model_extra["rayattn"]["rendered_by_router"] is False
    assert plain.usage.prompt_tokens == echo.usage.prompt_tokens
    assert "Paris" in plain.choices[0].message.content
    assert echo.choices[0].message.content.endswith(plain.choices[0].message.content)
    hops = plain.model_extra["rayattn"]["hops"]
    assert set(hops) == {"to_engine_s", "in_engine_s", "from_engine_s"}
    # One host's clock: each leg is non-negative (to the clock's resolution) and shorter
    # than the whole request.
    assert all(-1e-3 < v < 60 for v in hops.values()), hops
    text = client.completions.create(model=MODEL, prompt="The capital of France is",
                                     max_tokens=3, temperature=0, echo=True)
    assert text.choices[0].text.startswith("The capital of France is")
    assert text.model_extra["rayattn"]["rendered_by_router"] is False


def test_later_turns_reuse_the_earlier_turns_tokens(server, client):
    """A conversation's later turns are tokenized from where the earlier prompt ended
    (rayattn/server/incremental_tokenizer.py), and the engine, which serves the router's ids,
    sees the prompt it would have rendered itself: echo (the engine's own rendering) counts
    the same prompt tokens and gives the same answer."""
    def counts() -> dict:
        return httpx.get(f"{server}/health", timeout=30).json()["counts"]

    before = counts()
    msgs = [{"role": "system", "content": "Notes: " + " ".join(
        f"item {i} costs {i * 3} coins;" for i in range(80))}]
    prompts = []
    for question in ("What does item 7 cost?", "And item 12?", "Which is dearer?"):
        msgs.append({"role": "user", "content": question})
        plain = client.chat.completions.create(
            model=MODEL, messages=msgs, temperature=0, max_tokens=8,
            extra_body={"return_token_ids": True})
        echo = client.chat.completions.create(
            model=MODEL, messages=msgs, temperature=0, max_tokens=8,
            extra_body={"echo": True, "return_token_ids": True})
        assert plain.model_extra["rayattn"]["rendered_by_router"] is True
        assert echo.model_extra["rayattn"]["rendered_by_router"] is False
        # The very ids: the router's (reused heads + new tail) and the engine's own.
        assert plain.model_extra["prompt_token_ids"] == echo.model_extra["prompt_token_ids"]
        assert len(plain.model_extra["prompt_token_ids"]) == plain.usage.prompt_tokens
        assert echo.choices[0].message.content.endswith(plain.choices[0].message.content)
        msgs.append({"role": "assistant", "content": plain.choices[0].message.content})
        prompts.append(plain.usage.prompt_tokens)
    after = counts()
    reused = after["tokens_reused"] - before.get("tokens_reused", 0)
    # Turns 2 and 3 (and their echoes) reuse at least the first turn's whole prompt each.
    assert reused >= 4 * (prompts[0] - 4), (prompts, before, after)


def test_completions_endpoint(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is",
                                  max_tokens=5, temperature=0)
    assert "Paris" in r.choices[0].text
    assert r.usage.completion_tokens == 5 or r.choices[0].finish_reason == "stop"


def test_streaming_chunks_and_done(server, client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count from one to ten."}],
        temperature=0, max_tokens=24, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices]) > 3 and text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    # raw SSE ends with [DONE]
    with httpx.stream("POST", f"{server}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "Hello", "max_tokens": 8, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")


def test_repeated_long_prompt_reports_cached_tokens(client):
    doc = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(60))
    msgs = [{"role": "system", "content": doc}, {"role": "user", "content": "Summarise."}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4,
                                           temperature=0)
    second = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4,
                                            temperature=0)
    assert first.usage.prompt_tokens > 500
    assert second.usage.prompt_tokens_details.cached_tokens > 0.8 * first.usage.prompt_tokens
    assert second.model_extra["rayattn"]["path"] == "extend"
    assert second.model_extra["rayattn"]["route_reason"] == "affinity_hit"


def test_both_replicas_serve_requests(server):
    async def go():
        async with httpx.AsyncClient(timeout=120) as c:
            rs = await asyncio.gather(*(c.post(f"{server}/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 4,
                "messages": [{"role": "user", "content": f"Topic {i}: tell me about {i}"}]})
                for i in range(16)))
        return rs
    rs = asyncio.run(go())
    assert all(r.status_code == 200 for r in rs)
    replicas = {r.headers["x-rayattn-replica"] for r in rs}
    assert len(replicas) == 2 and replicas == set(httpx.get(f"{server}/health").json()
                                                  ["replicas_up"])


def _post(server: str, body, path: str = "/v1/chat/completions", **kw) -> httpx.Response:
    if isinstance(body, (dict, list)):
        return httpx.post(f"{server}{path}", json=body, timeout=60, **kw)
    return httpx.post(f"{server}{path}", content=body, timeout=60,
                      headers={"content-type": "application/json"}, **kw)


def _msgs(text: str = "hi") -> list[dict]:
    return [{"role": "user", "content": text}]


ERRORS = [
    ("malformed json", b'{"model": "smollm2", "messages": [', 400, None),
    ("not an object", [1, 2], 400, None),
    ("wrong type", {"model": MODEL, "messages": _msgs(), "max_tokens": "many"}, 400,
     "max_tokens"),
    ("empty messages", {"model": MODEL, "messages": []}, 400, "messages"),
    ("max_tokens zero", {"model": MODEL, "messages": _msgs(), "max_tokens": 0}, 400,
     "max_tokens"),
    ("max_tokens negative", {"model": MODEL, "messages": _msgs(), "max_tokens": -5}, 400,
     "max_tokens"),
    ("max_tokens above context", {"model": MODEL, "messages": _msgs(), "max_tokens": 5000},
     400, "2048"),
    ("message without role", {"model": MODEL, "messages": [{"content": "x"}]}, 400, "role"),
    ("unknown model", {"model": "gpt-17", "messages": _msgs()}, 404, "gpt-17"),
    ("n zero", {"model": MODEL, "messages": _msgs(), "n": 0}, 400, "n"),
    ("tool_choice without tools", {"model": MODEL, "messages": _msgs(),
                                   "tool_choice": "required"}, 400, "tool"),
    ("response_format unknown type", {"model": MODEL, "messages": _msgs(),
                                      "response_format": {"type": "yaml"}}, 400,
     "response_format"),
    ("top_logprobs without logprobs", {"model": MODEL, "messages": _msgs(),
                                       "top_logprobs": 3}, 400, "logprobs"),
]


@pytest.mark.parametrize("name,body,status,fragment", ERRORS, ids=[e[0] for e in ERRORS])
def test_client_errors(server, name, body, status, fragment):
    r = _post(server, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if fragment:
        assert fragment in err["message"] + str(err.get("param")), err


def test_prompt_longer_than_context_names_limit_and_length(server):
    r = _post(server, {"model": MODEL, "messages": _msgs("word " * 3000)})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    # vLLM's own check and wording, as `vllm serve` answers.
    assert "maximum context length is 2048 tokens" in msg


def test_oversized_body_and_unknown_route(server):
    r = _post(server, b'{"model": "' + b"x" * (5 * 1024 * 1024) + b'"}')
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]
    r = httpx.get(f"{server}/v1/nothing-here", timeout=10)
    assert r.status_code == 404 and "error" in r.json()


def test_models_and_health(server):
    assert httpx.get(f"{server}/v1/models").json()["data"][0]["id"] == MODEL
    h = httpx.get(f"{server}/health").json()
    assert h["status"] == "ok" and len(h["replicas_up"]) == 2
    assert sorted(e["rank"] for e in h["engines"].values()) == [0, 1]
    assert h["reason"] is None


def test_clients_reach_the_router_through_haproxy(ray_cluster, server):
    """The Ray the tests start (as make serve's) takes requests through Serve's HAProxy
    ingress: HAProxy owns the HTTP port, and the router says it was set up for it."""
    owners = {p.name() for p in _listeners(ray_cluster["http_port"])}
    assert owners == {"haproxy"}, owners
    from tests.conftest import session_header

    door = httpx.get(f"{server}/health").json()["front_door"]
    # Routers picked by the session header the router itself uses.
    assert door == {"mode": "haproxy", "balance": f"hdr({session_header()})", "note": None}, \
        door
    r = httpx.post(f"{server}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def _transport(server: str, name: str) -> None:
    r = httpx.post(f"{server}/admin/reset", timeout=60,
                   json={"policy": "affinity", "settings": {"engine_transport": name}})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("transport", ["direct", "grpc"])
def test_each_engine_transport_serves_streams_errors_and_hang_ups(server, client, transport):
    """router.engine_transport: `direct` (the default: the router POSTs to each engine
    replica's own endpoint, engine/direct_server.py) and Serve's `grpc` channel give the same
    answers, streams and errors; a client that hangs up aborts the engine request."""
    counts = lambda: httpx.get(f"{server}/health").json()["counts"]  # noqa: E731
    _transport(server, transport)
    try:
        before = counts()
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        r = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                           max_tokens=12)
        assert "Paris" in r.choices[0].message.content
        assert r.model_extra["rayattn"]["rendered_by_router"] is True
        chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time",
                                                max_tokens=5, stream=True,
                                                extra_body={"ignore_eos": True},
                                                stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens == 5
        # An engine-side rejection keeps its 400 and names the field (vLLM's own check:
        # the router does not know the model's vocabulary).
        bad = _post(server, {"model": MODEL, "messages": _msgs(),
                             "logit_bias": {"999999": 1}})
        assert bad.status_code == 400, bad.text
        after = counts()
        direct = after["direct_calls"] - before["direct_calls"]
        assert direct >= 3 if transport == "direct" else direct == 0, (before, after)
        assert after["retried"] == before["retried"] and after["failed"] == before["failed"]
        test_disconnect_mid_stream_aborts_engine_request(server)
        assert (counts()["direct_calls"] > after["direct_calls"]) == (transport == "direct")
    finally:
        _transport(server, "direct")


def test_disconnect_mid_stream_aborts_engine_request(server):
    body = {"model": MODEL, "prompt": "Write a very long story about a dragon.",
            "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as r:
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data: ")
            if n >= 3:
                break  # hang up with ~1,500 tokens still to generate
    engines = _engines_drain(server, 20)
    # At CPU speed 1,500 tokens take far longer than 20 s: reaching zero means aborted.
    assert all(e["unfinished"] == 0 for e in engines.values()), engines
    assert all(e["inflight"] == 0 for e in engines.values()), engines


def _engines_drain(server: str, within_s: float) -> dict:
    """The engines as the router last saw them: once none has a request left, or at
    `within_s`."""
    deadline = time.time() + within_s
    while True:
        engines = httpx.get(f"{server}/health", timeout=30).json()["engines"]
        if all(e["unfinished"] == 0 and e["inflight"] == 0 for e in engines.values()) \
                or time.time() > deadline:
            return engines
        time.sleep(0.5)


def _listeners(port: int) -> list:
    """The live processes listening on `port` (psutil.Process, name and command line read)."""
    import psutil

    out = []
    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid:
            try:
                proc = psutil.Process(c.pid)
                proc.name(), proc.cmdline()  # read now: the process may be gone later
            except psutil.Error:  # an HAProxy worker replaced by a reload
                continue
            out.append(proc)
    return out


def _router_port(http_port: int) -> int:
    """The router replica's own HTTP port, from the config of the HAProxy that owns
    `http_port`."""
    from tests.conftest import local_config

    app = local_config()["applications"][0]["name"]
    owners = _listeners(http_port)
    assert owners, f"nothing listens on {http_port}"
    haproxy = [p for p in owners if p.name() == "haproxy"]
    if not haproxy:
        pytest.skip("clients reach the router through Serve's proxy, not HAProxy")
    cmd = haproxy[0].cmdline()
    cfg = Path(cmd[cmd.index("-f") + 1]).read_text()
    found = re.search(rf"server SERVE_REPLICA_{re.escape(app)}-router-\S+ [^\s:]+:(\d+)", cfg)
    assert found, cfg
    return int(found.group(1))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_hang_up_on_a_whole_answer_aborts_engine_request(ray_cluster, server, path):
    """A client that leaves while its non-streaming answer is being generated ends the
    engine's work at once, as a stream's client does.

    The test connects where HAProxy does, to the router replica's own port: through Serve's
    HAProxy the hang-up reaches the router only sometimes (docs/routing.md, "Failure
    semantics")."""
    ask = ({"prompt": "Write a very long story about a dragon."} if "chat" not in path
           else {"messages": _msgs()})
    body = {"model": MODEL, **ask, "max_tokens": 1500, "ignore_eos": True}
    router = f"http://127.0.0.1:{_router_port(ray_cluster['http_port'])}"

    async def leave_once_running() -> dict:
        async with httpx.AsyncClient(timeout=120) as http:
            call = asyncio.create_task(http.post(f"{router}{path}", json=body))
            engines: dict = {}
            deadline = time.time() + 60
            while time.time() < deadline and not call.done():
                engines = (await http.get(f"{server}/health")).json()["engines"]
                if any(e["unfinished"] for e in engines.values()):
                    break  # the engine runs it: hang up now
                await asyncio.sleep(0.2)
            assert not call.done(), "answered before the engine was seen running it"
            call.cancel()  # closes the connection, as a client's read timeout does
            await asyncio.gather(call, return_exceptions=True)
            return engines

    running = asyncio.run(leave_once_running())
    assert any(e["unfinished"] for e in running.values()), running
    # At CPU speed 1,500 tokens take far longer than 20 s: reaching zero means aborted.
    engines = _engines_drain(server, 20)
    assert all(e["unfinished"] == 0 for e in engines.values()), engines
    assert all(e["inflight"] == 0 for e in engines.values()), engines


def test_503_with_retry_after_when_no_replica_is_ready(ray_cluster, server):
    from ray import serve

    from rayattn.app import Engine, Router, engine_options
    from rayattn.config.loader import parse_args
    from rayattn.config.plan import build_plan
    from tests.conftest import local_args

    # An engine deployment none of whose replicas can start (its model is missing).
    broken = {**local_args(), "model": {**local_args()["model"], "source": "/nonexistent"}}
    opts = engine_options(build_plan(parse_args(local_args())))
    # One replica is enough to never start (each failed start costs the machine an engine's
    # imports).
    opts.pop("autoscaling_config", None)
    none = Engine.options(**{**opts, "num_replicas": 1}).bind(broken)
    # That app never runs: don't wait for it.
    serve.run_many([serve.RunTarget(Router.options(name="router-empty").bind(local_args(), none),
                                    name="empty", route_prefix="/empty")],
                   wait_for_applications_running=False)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            r = httpx.post(f"{server}/empty/v1/chat/completions", timeout=30,
                           json={"model": MODEL, "messages": _msgs()})
        except httpx.TimeoutException:
            # Serve's proxy holds the request while the router replica is still starting
            # (tens of seconds on a loaded 2-core machine): ask again.
            continue
        if r.status_code != 404:  # the route exists once the app is up
            break
        time.sleep(0.25)
    models = httpx.get(f"{server}/empty/v1/models", timeout=30)
    health = httpx.get(f"{server}/empty/health", timeout=30)
    serve.delete("empty", _blocking=False)  # nothing of it is needed again
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) > 0
    assert "no engine replica" in r.json()["error"]["message"]
    # Not ready is said everywhere a client or a readiness probe looks.
    assert models.status_code == 503 and "not ready" in models.json()["error"]["message"]
    assert health.status_code == 503 and "not ready" in health.json()["reason"]
