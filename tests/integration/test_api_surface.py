"""API keys and request ids on a real router in front of the shared engines."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from rayattn.bench.cli import wait_healthy
from tests.conftest import local_args

pytestmark = pytest.mark.integration
MODEL = "smollm2"
ADMIN_KEY = "keyed-admin"
KEY_CAP = 4
"""The keyed router's per-key cap on the engines (`router.key_max_inflight`)."""
CHAT = {"model": MODEL, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hi."}]}


def _router(name: str, args: dict, env: dict[str, str], engines):
    """A router deployment as rayattn.app builds one (its Serve options: no Serve queue in
    front of it, the hash seed), under another name, with `env` in its processes."""
    from rayattn.app import Router, router_options
    from rayattn.config.loader import parse_args

    opts = router_options(parse_args(args))
    actor = opts["ray_actor_options"]
    actor["runtime_env"]["env_vars"].update(env)
    opts.pop("user_config")  # the router settings come with args here
    return Router.options(**{**opts, "name": name}).bind(args, engines)


@pytest.fixture(scope="module")
def tenants(server):
    """A second router on the same engines whose keys come from its environment, with a
    per-key cap on the engines: `key-one` and `key-two` for the key and
    isolation tests, `greedy-key` and `light-key` for the fair-share one (one router start
    for both)."""
    from ray import serve

    args = local_args()
    args["router"] = {**args["router"], "api_keys_env": "TEST_API_KEYS", "admin_api": True,
                      "admin_keys_env": "TEST_ADMIN_KEYS", "max_inflight": 512,
                      "key_max_inflight": KEY_CAP}
    engines = serve.get_deployment_handle("engine", app_name="rayattn")
    keys = "key-one, key-two, greedy-key, light-key"
    env = {"TEST_API_KEYS": keys, "TEST_ADMIN_KEYS": ADMIN_KEY}
    serve.run(_router("router-keyed", args, env, engines),
              name="keyed", route_prefix="/keyed", blocking=False)
    url = f"{server}/keyed"
    # /health is open, so readiness needs no key.
    wait_healthy(url)
    yield url
    serve.delete("keyed", _blocking=False)
    _engines_idle(server)  # what follows needs idle engines, not this router's exit


def _engines_idle(server: str) -> None:
    """Once no engine runs or holds a request (what follows a load needs idle engines)."""
    deadline = time.monotonic() + 120
    while any(e["inflight"] or e["unfinished"] for e in httpx.get(
            f"{server}/health", timeout=30).json()["engines"].values()):
        assert time.monotonic() < deadline, "the shared engines never went idle"
        time.sleep(0.25)


def _counts(url: str) -> dict[str, float]:
    """A router's own counts (its /health details, for its admin key)."""
    r = httpx.get(f"{url}/health", timeout=30, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    return r.json()["counts"]


def _router_idle(url: str) -> None:
    """Once the router holds no request (every slot given back: ended, or dropped when its
    client's hang-up reached it)."""
    deadline = time.monotonic() + 120
    while _counts(url)["admitted_now"]:
        assert time.monotonic() < deadline, "the router never let go of its requests"
        time.sleep(0.25)


@pytest.fixture
def keyed(tenants):
    return tenants


@pytest.fixture
def shared_by_two_keys(tenants):
    return tenants


def test_api_keys_401_without_and_200_with(keyed):
    from openai import AuthenticationError, OpenAI

    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "key-one"}):
        r = httpx.post(f"{keyed}/v1/chat/completions", json=CHAT, headers=headers, timeout=60)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{keyed}/v1/models", timeout=60).status_code == 401
    assert httpx.get(f"{keyed}/health", timeout=60).status_code == 200
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{keyed}/v1", api_key="wrong", max_retries=0).models.list()
    client = OpenAI(base_url=f"{keyed}/v1", api_key="key-two", max_retries=0, timeout=120)
    out = client.chat.completions.create(**CHAT)
    assert out.choices[0].message.content
    assert [m.id for m in client.models.list().data] == [MODEL]
    # An API key does not open the admin API (only the admin key does).
    r = httpx.post(f"{keyed}/admin/reset", json={}, timeout=60,
                   headers={"Authorization": "Bearer key-one"})
    assert r.status_code == 401 and "admin" in r.json()["error"]["message"]


def test_the_router_tier_grows_on_its_cpu_and_refuses_a_switch_that_reaches_one(server):
    """A router tier of 1..2 replicas whose target CPU any traffic exceeds: under requests,
    Serve's autoscaler (rayattn's policy, run in Serve's controller on the CPU each router
    reports) starts the second router. A request reaches one router replica: a policy
    switched through /admin/reset would leave the other on the old one (a benchmark would
    compare a mix). It is refused with what to do instead; a plain reset still works."""
    from ray import serve

    args = local_args()
    args["router"] = {**args["router"], "admin_api": True}
    args["serve"] = {**args.get("serve", {}), "router_tier": {
        "min_replicas": 1, "max_replicas": 2, "target_cpu": 0.01, "upscale_delay_s": 0,
        "look_back_period_s": 3, "metrics_interval_s": 1}}
    engines = serve.get_deployment_handle("engine", app_name="rayattn")
    serve.run(_router("router-scaled", args, {}, engines), name="scaled",
              route_prefix="/scaled", blocking=False)
    url = f"{server}/scaled"

    def running() -> int:
        d = serve.status().applications["scaled"].deployments["router-scaled"]
        return d.replica_states.get("RUNNING", 0)

    try:
        wait_healthy(url)
        # A report or two (every second here), then the second router's start.
        deadline = time.monotonic() + 120
        with httpx.Client(timeout=60) as c:
            while running() < 2 and time.monotonic() < deadline:
                assert c.post(f"{url}/v1/chat/completions", json=CHAT).status_code == 200
        assert running() == 2, "the router tier did not grow under load"
        before = httpx.post(f"{url}/admin/reset", json={}, timeout=60)
        assert before.status_code == 200, before.text
        other = "round_robin" if before.json()["policy"] != "round_robin" else "affinity"
        for body, field in (({"policy": other}, "policy"),
                            ({"settings": {"policy": other}}, "policy"),
                            ({"index": "predicted"}, "index")):
            r = httpx.post(f"{url}/admin/reset", json=body, timeout=60)
            assert r.status_code == 409, (body, r.text)
            err = r.json()["error"]
            assert "user_config" in err["message"] and "2 router replicas" in err["message"]
            assert err["param"] == field
        # What `rayattn bench --ingress` sends after switching through user_config: the
        # policy already in force is not a switch.
        same = httpx.post(f"{url}/admin/reset", json={"policy": before.json()["policy"]},
                          timeout=60)
        assert same.status_code == 200, same.text
        after = httpx.post(f"{url}/admin/reset", json={}, timeout=60)
        assert after.status_code == 200, after.text
        assert after.json()["policy"] == before.json()["policy"]
        assert after.json()["index"] == before.json()["index"]
    finally:
        serve.delete("scaled", _blocking=False)  # nothing of it is needed again


def test_tenants_see_neither_the_routers_account_nor_healths_details(keyed, server):
    """Where another tenant's prompt is cached (predicted hits, route reason, replicas'
    load) is an oracle on that prompt: only callers that could open the admin API see it.
    With API keys and no admin key configured, that is nobody."""
    key = {"Authorization": "Bearer key-one"}
    r = httpx.post(f"{keyed}/v1/chat/completions", json=CHAT, headers=key, timeout=60)
    assert r.status_code == 200 and "rayattn" not in r.json(), r.text
    assert "x-rayattn-replica" not in r.headers
    with httpx.stream("POST", f"{keyed}/v1/chat/completions", headers=key, timeout=60,
                      json={**CHAT, "stream": True}) as s:
        events = [ln for ln in s.iter_lines() if ln.startswith("data: {")]
        assert "x-rayattn-replica" not in s.headers
    assert events and not any('"rayattn"' in e for e in events)
    for headers in ({}, key):
        h = httpx.get(f"{keyed}/health", headers=headers, timeout=60)
        assert h.status_code == 200 and set(h.json()) == {"status", "reason", "up", "of"}
        assert h.json()["up"] == h.json()["of"] > 0
    # Without any key configured (a local deployment) every caller is the operator.
    r = httpx.post(f"{server}/v1/chat/completions", json=CHAT, timeout=60)
    assert r.json()["rayattn"]["replica"] == r.headers["x-rayattn-replica"]
    assert "engines" in httpx.get(f"{server}/health", timeout=60).json()


def test_request_id_is_echoed_and_is_the_completion_id(server):
    r = httpx.post(f"{server}/v1/chat/completions", json=CHAT, timeout=60,
                   headers={"x-request-id": "trace-abc-123"})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "trace-abc-123"
    assert r.json()["id"] == "chatcmpl-trace-abc-123"  # vLLM's prefix, the client's id
    with httpx.stream("POST", f"{server}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "One two", "max_tokens": 4,
                            "stream": True}, headers={"x-request-id": "trace-stream-9"}) as s:
        assert s.headers["x-request-id"] == "trace-stream-9"
        ids = {json.loads(ln[6:])["id"] for ln in s.iter_lines()
               if ln.startswith("data: {")}
    assert ids == {"cmpl-trace-stream-9"}
    # Without one, a fresh id (Serve's) comes back in both places.
    a, b = (httpx.post(f"{server}/v1/chat/completions", json=CHAT, timeout=60)
            for _ in range(2))
    assert a.json()["id"] == f"chatcmpl-{a.headers['x-request-id']}" != b.json()["id"]
    bad = httpx.post(f"{server}/v1/chat/completions", json=CHAT, timeout=60,
                     headers={"x-request-id": "x" * 129})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-request-id"


def test_one_tenant_cannot_learn_from_the_cache_what_another_sent(keyed):
    """With API keys, each key's prompts are cached in their own namespace (vLLM's
    cache_salt, derived per key and hashed into the router's keys): tenant B sending
    tenant A's exact conversation gets no cached token, while A's own later turns are
    served from cache as before. Before the fix B saw A's prefix as cached."""
    a, b = ({"Authorization": f"Bearer {k}"} for k in ("key-one", "key-two"))
    doc = " ".join(f"Clause {i}: the tenant's private term number {i * 7919 % 1000}."
                   for i in range(40))
    messages = [{"role": "user", "content": f"{doc}\nSummarise clause 3."}]

    def chat(headers: dict, msgs: list, session: str) -> dict:
        r = httpx.post(f"{keyed}/v1/chat/completions", timeout=120, headers={
            **headers, "x-session-id": session}, json={**CHAT, "max_tokens": 8,
                                                        "messages": msgs})
        assert r.status_code == 200, r.text
        return r.json()

    def cached(out: dict) -> int:
        return (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    first = chat(a, messages, "conv")
    for turn in range(2):
        prev_tokens = first["usage"]["prompt_tokens"]
        messages += [first["choices"][0]["message"], {"role": "user",
                                                      "content": f"And clause {turn + 5}?"}]
        first = chat(a, messages, "conv")
        # A's earlier prompt is a prefix of this one: its full blocks come from cache.
        assert cached(first) >= prev_tokens // 32 * 32 > 0, (first["usage"], prev_tokens)
    # B replays A's whole conversation, under the same session id: nothing of it is cached
    # for B (its only request), and the router's account of it is not shown.
    probe = chat(b, messages, "conv")
    assert cached(probe) == 0, probe["usage"]
    assert "rayattn" not in probe
    # ...while A, asking the same again, is served from cache.
    assert cached(chat(a, messages, "conv")) >= first["usage"]["prompt_tokens"] // 32 * 32 - 32


def test_a_greedy_key_does_not_starve_another(shared_by_two_keys, server):
    """200 long streams from one key; another key's short requests keep their time to first
    token within 2x of what they get on idle engines. Before, the greedy key took every
    engine slot this router may use (and the engines' own queues), and the other key's
    requests waited for its streams to end.

    Then the greedy client hangs up on its streams, most still queued behind its key's cap:
    they never reach an engine. Before router.stream_commit_s, HAProxy (which notices a
    client that left only when it writes to it) kept each queued request's connection to
    the router open, and every one of them ran on an engine in turn for nobody (200 engine
    calls, 34 s of engine time after the client left)."""
    import asyncio
    import statistics
    import time

    url = f"{shared_by_two_keys}/v1/chat/completions"
    greedy = {"Authorization": "Bearer greedy-key"}
    light = {"Authorization": "Bearer light-key"}

    async def ttft(c: httpx.AsyncClient, i: int) -> float:
        t0 = time.perf_counter()
        async with c.stream("POST", url, headers=light, json={
                **CHAT, "max_tokens": 2, "stream": True,
                "messages": [{"role": "user", "content": f"Say hi, number {i}."}]}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"content"' in line:
                    return time.perf_counter() - t0
        raise AssertionError("no token")

    async def hog(c: httpx.AsyncClient, i: int) -> int:
        try:
            async with c.stream("POST", url, headers=greedy, json={
                    **CHAT, "max_tokens": 400, "ignore_eos": True, "stream": True,
                    "messages": [{"role": "user", "content": f"Story {i}."}]}) as r:
                async for _ in r.aiter_lines():
                    pass
                return r.status_code
        except (httpx.HTTPError, asyncio.CancelledError):
            return -1

    async def go() -> tuple[list[float], list[float]]:
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
        async with httpx.AsyncClient(timeout=300, limits=limits) as c:
            await ttft(c, -1)  # warm
            idle = [await ttft(c, i) for i in range(20)]
            hogs = [asyncio.create_task(hog(c, i)) for i in range(200)]
            await _greedy_queued(c, 200)
            busy = [await ttft(c, 100 + i) for i in range(20)]
            calls.append(_counts(shared_by_two_keys)["direct_calls"])
            for h in hogs:
                h.cancel()
            await asyncio.gather(*hogs, return_exceptions=True)
        return idle, busy

    async def _greedy_queued(c: httpx.AsyncClient, n: int) -> None:
        """Once the router holds all `n` greedy streams (its key's cap running on the
        engines, the rest queued behind it) and the engines run the cap's streams."""
        deadline = time.monotonic() + 120
        while True:
            r = await c.get(f"{shared_by_two_keys}/health",
                            headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            counts = r.json()["counts"]
            # The light key's warm-up and 20 idle requests, then the greedy key's cap.
            if counts["admitted_now"] >= n and \
                    counts["direct_calls"] - calls[0] >= 1 + 20 + KEY_CAP:
                return
            assert time.monotonic() < deadline, ("the greedy streams never all arrived", counts)
            await asyncio.sleep(0.2)

    calls: list[float] = [_counts(shared_by_two_keys)["direct_calls"]]
    idle, busy = asyncio.run(go())
    _router_idle(shared_by_two_keys)
    calls.append(_counts(shared_by_two_keys)["direct_calls"])
    after = calls[2] - calls[1]
    print(f"greedy streams that reached an engine after the client hung up: {after:.0f} "
          f"(of the {200 - (calls[1] - calls[0] - 41):.0f} still queued or running)")
    # The calls went over the direct transport, where they are counted: the light key's
    # 41 at least.
    assert calls[1] - calls[0] >= 41, calls
    # Those dispatched while the hang-up was on its way (a waiting comment a second) reach an
    # engine; without the comments every queued one did (196 of 196 in the run before).
    assert after < 100, calls
    p90 = lambda xs: statistics.quantiles(xs, n=10)[-1]  # noqa: E731
    print(f"\nlight key TTFT p90 idle {p90(idle):.3f}s, beside 200 greedy streams "
          f"{p90(busy):.3f}s")
    # 2x, or 0.5 s above idle where idle is a few tenths: on 2 shared cores, with the client's
    # 200 streams on them too, scheduling noise alone took a 0.17 s idle p90 to 0.35 s in one
    # fresh-clone run and a 0.14 s one to 0.41 s (one light request at 1.0 s) in another.
    # Starvation, what this guards against, was a 118 s wait.
    assert p90(busy) <= max(2 * p90(idle), p90(idle) + 0.5), (idle, busy)
