"""An engine replica that runs two DP ranks inside itself (parallelism.engine_dp_size: vLLM's
own data parallelism, each rank its own scheduler and KV cache), on real CPU engines: the
router routes to each rank as a target of its own, vLLM runs each request on the rank the
router chose, and the router's view of each rank's cache is that rank's own events.

Runs on an application of its own (one engine replica, two ranks; tests/own_apps.py) in
place of the shared one."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from rayattn.config.loader import app_args, parse_args
from rayattn.config.plan import build_plan
from rayattn.routing.targets import split
from tests.conftest import local_config
from tests.own_apps import DP_APP

pytestmark = [pytest.mark.integration, pytest.mark.own_app]
MODEL = "smollm2"
DOC = "Notes on block {n}. " + " ".join(f"Rank {{n}} keeps block {i} warm." for i in range(60))


@pytest.fixture(scope="module")
def dp_app(own_apps):
    return own_apps[DP_APP]


def reset(url: str, policy: str, **settings) -> None:
    r = httpx.post(f"{url}/admin/reset", json={"policy": policy, "settings": settings},
                   timeout=60)
    assert r.status_code == 200, r.text


def ask(url: str, messages: list[dict], session: str | None = None) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                   headers={"x-session-id": session} if session else {},
                   json={"model": MODEL, "max_tokens": 8, "temperature": 0,
                         "messages": messages})
    assert r.status_code == 200, r.text
    return r.json()


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_each_rank_is_a_cache_of_its_own_and_runs_what_the_router_sends_it(dp_app):
    """round_robin alternates the ranks: the same prompt misses on the second rank (its
    cache is not the first's) and hits on each rank after that, exactly as the router
    predicted from each rank's own events. If vLLM ignored the chosen rank, its balancer
    would run the idle repeats on one rank and the second one would hit."""
    health = httpx.get(f"{dp_app}/health", timeout=30).json()
    targets = sorted(health["engines"])
    assert len(targets) == 2 and {split(t)[1] for t in targets} == {0, 1}
    assert len({split(t)[0] for t in targets}) == 1, targets
    assert (health["up"], health["of"]) == (1, 1)  # engine replicas, not targets
    # Each rank holds engine.kv_cache_memory_bytes of KV: its own capacity, not vLLM's sum.
    plan = build_plan(parse_args(app_args(local_config()["applications"][0])))
    per_rank = plan.config.engine.kv_cache_memory_bytes // (plan.block_size
                                                            * plan.kv_bytes_per_token)
    assert [health["engines"][t]["kv_blocks"] for t in targets] == [per_rank] * 2
    assert [health["engines"][t]["engine_rank"] for t in targets] == [0, 1]
    reset(dp_app, "round_robin")
    msgs = [{"role": "user", "content": DOC.format(n=1)}]
    seen = []
    for _ in range(4):
        body = ask(dp_app, msgs)
        account = body["rayattn"]
        seen.append((account["replica"], cached(body), account["predicted_cached_tokens"]))
        time.sleep(0.5)  # the rank's events reach the router before the next request
    print(f"\n(rank, cached, predicted): {seen}")
    assert [s[0] for s in seen] == [seen[0][0], seen[1][0]] * 2 and seen[0][0] != seen[1][0]
    assert [s[1] for s in seen[:2]] == [0, 0]
    assert seen[2][1] > 0 and seen[3][1] == seen[2][1]
    assert [s[1] for s in seen] == [s[2] for s in seen]
    # The prediction came from each rank's own events, not from the router's guess.
    views = {t: e["cache_view"] for t, e in
             httpx.get(f"{dp_app}/health", timeout=30).json()["engines"].items()}
    assert all(v.get("batches", 0) > 0 and v["blocks"] > 0 for v in views.values()), views


def test_affinity_keeps_each_conversation_on_its_rank_and_spreads_them(dp_app, ray_cluster):
    reset(dp_app, "affinity")
    convs = {c: [{"role": "user", "content": DOC.format(n=10 + c)}] for c in range(4)}

    def turn(c: int) -> tuple[str, int, int]:
        body = ask(dp_app, convs[c], session=f"conv-{c}")
        convs[c] += [body["choices"][0]["message"],
                     {"role": "user", "content": f"And block {c}, again?"}]
        a = body["rayattn"]
        return a["replica"], cached(body), a["predicted_cached_tokens"]

    homes: dict[int, set[str]] = {c: set() for c in convs}
    later: list[tuple[int, int]] = []
    with ThreadPoolExecutor(4) as pool:
        for n in range(3):
            for c, (where, got, predicted) in zip(convs, pool.map(turn, convs), strict=True):
                homes[c].add(where)
                if n:
                    later.append((got, predicted))
            time.sleep(0.5)
    print(f"\nhomes {homes}; later turns (cached, predicted) {later}")
    assert all(len(h) == 1 for h in homes.values()), homes
    assert len(set().union(*homes.values())) == 2, "conversations should use both ranks"
    assert all(got > 0 and got == predicted for got, predicted in later), later
    # Per-path metrics carry the rank inside the engine.
    url = f"http://127.0.0.1:{ray_cluster['metrics_port']}/metrics"
    pattern = re.compile(r'^ray_rayattn_requests_total\{[^}]*engine_rank="(\d)"', re.M)
    deadline = time.time() + 30
    while (seen := set(pattern.findall(httpx.get(url, timeout=10).text))) != {"0", "1"} \
            and time.time() < deadline:
        time.sleep(1)
    assert seen == {"0", "1"}, seen


def test_switching_rank_routing_live_loses_no_request(dp_app):
    """router.dp_rank_routing off: the replica is one target and vLLM's balancer picks the
    rank; switched both ways while streams run, every request is answered."""
    def stream(n: int) -> str:
        with httpx.stream("POST", f"{dp_app}/v1/chat/completions", timeout=120, json={
                "model": MODEL, "max_tokens": 48, "temperature": 0, "stream": True,
                "messages": [{"role": "user", "content": DOC.format(n=200 + n)}]}) as r:
            assert r.status_code == 200, r.read()
            return "".join(r.iter_lines())

    with ThreadPoolExecutor(6) as pool:
        running = [pool.submit(stream, n) for n in range(6)]
        time.sleep(1.0)
        reset(dp_app, "affinity", dp_rank_routing=False)
        try:
            health = httpx.get(f"{dp_app}/health", timeout=30).json()
            (target,) = health["engines"]
            assert split(target)[1] is None and health["engines"][target]["engine_rank"] is None
            body = ask(dp_app, [{"role": "user", "content": DOC.format(n=99)}])
            assert body["rayattn"]["replica"] == target
            later = [pool.submit(stream, n) for n in range(6, 9)]
        finally:
            reset(dp_app, "affinity", dp_rank_routing=True)
        answers = [f.result() for f in running + later]
    assert all("[DONE]" in a for a in answers)
    health = httpx.get(f"{dp_app}/health", timeout=30).json()
    assert len(health["engines"]) == 2
    assert all(e["inflight"] == 0 for e in health["engines"].values()), health["engines"]
