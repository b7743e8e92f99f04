"""The router's picture of the engines is the engines' own: KV events, engine-reported load,
probes that cannot starve, request errors that are the client's. Real Ray, real vLLM."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time

import httpx
import pytest

from rayattn.bench.cli import wait_healthy
from rayattn.bench.driver import oracle, run_workload, summarize
from rayattn.bench.workloads import multi_turn
from tests.conftest import local_args

pytestmark = pytest.mark.integration
MODEL = "smollm2"
BLOCK = 32


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=30).json()


@pytest.fixture(scope="module")
def tokenizer(server):
    from transformers import AutoTokenizer

    from rayattn.models.embedded import resolve_embedded

    return AutoTokenizer.from_pretrained(str(resolve_embedded("rayattn://smollm2-135m")))


def test_kv_event_index_predicts_every_cached_token(server, reset, tokenizer):
    """Multi-turn at concurrency 8 on 2 replicas: for every request the router's prediction
    (from the engines' KV events) equals the cached tokens the engine reports."""
    reset("affinity")
    assert health(server)["index"] == "events"
    wl = multi_turn(conversations=8, turns=4, shared_systems=8, system_words=150, seed=5)
    res, wall = asyncio.run(run_workload(server, MODEL, wl, concurrency=8))
    s = summarize(res, wall)
    o = oracle(res, wl, tokenizer, BLOCK)
    print(f"\nevents index: {s} {o}")
    assert s["ok"] == 32
    wrong = [(r.session, r.turn, r.predicted_cached_tokens, r.cached_tokens)
             for r in res if r.predicted_cached_tokens != r.cached_tokens]
    assert not wrong, wrong
    assert s["hit_rate"] >= 0.97 * o["oracle_block_hit_rate"]
    views = health(server)["engines"]
    assert all(v["cache_view"]["blocks"] > 0 and v["cache_view"]["batches"] > 0
               for v in views.values()), views


def test_a_reset_says_it_emptied_every_cache_and_did(server, reset):
    """/admin/reset answers `cold` only when every engine emptied its cache: a prompt served
    from cache before it is computed afresh after it (what a benchmark's cold run relies
    on)."""
    reset("affinity")
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content":
            "Keep this in mind. " + " ".join(f"item{i}" for i in range(300))}]}

    def cached() -> int:
        r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=120,
                       headers={"x-session-id": "reset-check"})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached()
    assert cached() > 0  # warm
    r = httpx.post(f"{server}/admin/reset", json={"policy": "affinity"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["cold"] is True and r.json()["not_emptied"] == [], r.json()
    assert cached() == 0


def test_two_routers_share_one_truth(ray_cluster, server, reset, tokenizer):
    """A second, independent router on the same engines: turns alternate between the two,
    and each still finds the history the other one placed."""
    from ray import serve

    from rayattn.app import Router

    reset("affinity")
    engines = serve.get_deployment_handle("engine", app_name="rayattn")
    serve.run(Router.options(name="router-b").bind(local_args(), engines), name="second",
              route_prefix="/second", blocking=False)
    other = f"{server}/second"
    wait_healthy(other)
    try:
        wl = multi_turn(conversations=6, turns=4, shared_systems=6, system_words=150, seed=9)
        # Users read an answer before they write the next turn. With none at all, a turn can
        # reach the other router before the engine's events of the previous one do (the
        # known cross-router race): with the benchmark client's own queueing gone, that lost
        # 4 of 18 later turns in one fresh-clone run here.
        res, wall = asyncio.run(run_workload([server, other], MODEL, wl, concurrency=6,
                                             think_s=0.5))
        s = summarize(res, wall)
        o = oracle(res, wl, tokenizer, BLOCK)
        print(f"\ntwo routers: {s} {o}")
        assert s["ok"] == 24
        later = [r for r in res if r.turn > 0]
        # Each router knew exactly what the engine held, history the other one placed
        # included. A router may still choose to move one conversation (its cost model, with
        # the other router's load known only from engine reports); a router blind to the
        # other's history would miss on most later turns.
        wrong = [(r.session, r.turn, r.replica, r.predicted_cached_tokens, r.cached_tokens)
                 for r in later if r.predicted_cached_tokens != r.cached_tokens]
        print(f"(session, turn, replica, predicted, cached) off: {wrong}")
        # Never a hit the engine does not have. A turn that reaches the other router before
        # the engine's events of the previous answer do (2 loaded cores) is predicted short:
        # exactness failed on 3 of 7 runs of this test on one machine.
        # Turns alternate routers, so a router blind to the other's history would be short
        # on nearly every later turn.
        assert all(r.predicted_cached_tokens <= r.cached_tokens for r in later), wrong
        assert len(wrong) <= len(later) // 3, wrong
        assert sum(1 for r in later if r.moved_from) <= 1, [r.reason for r in later]
        assert s["hit_rate"] >= 0.9 * o["oracle_block_hit_rate"]
        time.sleep(1.0)  # let the last events land on both
        a, b = health(server)["engines"], health(other)["engines"]
        for name in a:
            assert a[name]["cache_view"]["blocks"] == b[name]["cache_view"]["blocks"] > 0
        # A reset through one router empties the engines; the other router knows at once,
        # not at the engines' next step (idle engines take none).
        reset("affinity")
        deadline = time.time() + 5
        while any(e["cache_view"]["blocks"] for e in health(other)["engines"].values()):
            assert time.time() < deadline, health(other)["engines"]
            time.sleep(0.1)
    finally:
        serve.delete("second", _blocking=False)  # nothing of it is needed again


def test_engine_validation_error_is_one_400_without_retry(server):
    before = health(server)
    r = httpx.post(f"{server}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 4, "stop": [""],
        "messages": [{"role": "user", "content": "hello"}]})
    after = health(server)
    assert r.status_code == 400, r.text
    assert "empty string" in r.json()["error"]["message"]  # vLLM's own words
    assert after["counts"]["retried"] == before["counts"]["retried"]
    assert after["counts"]["failed"] == before["counts"]["failed"]
    assert all(e["downs"] == before["engines"][n]["downs"] for n, e in after["engines"].items())


def _burn(stop: float) -> None:
    while time.time() < stop:
        pass


def test_probes_under_saturation_never_mark_a_replica_down(server):
    """Both cores busy with other work and more generation in flight than the engines'
    request limit: the routers' probes must still get through, no replica goes down, no
    request fails."""
    before = health(server)
    n = 2 * local_args()["serve"]["max_ongoing_requests"] + 16
    stop = time.time() + 40
    hogs = [mp.get_context("spawn").Process(target=_burn, args=(stop,)) for _ in range(2)]
    for h in hogs:
        h.start()
    samples: list[list[str]] = []

    async def watch(done: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=60) as c:
            while not done.is_set():
                samples.append((await c.get(f"{server}/health")).json()["replicas_up"])
                await asyncio.sleep(0.5)

    async def go():
        done = asyncio.Event()
        w = asyncio.create_task(watch(done))
        async with httpx.AsyncClient(timeout=300) as c:
            rs = await asyncio.gather(*(c.post(f"{server}/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 48, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"saturate {i}"}]})
                for i in range(n)))
        done.set()
        await w
        return rs

    try:
        rs = asyncio.run(go())
    finally:
        for h in hogs:
            h.terminate()
            h.join()
    after = health(server)
    codes = [r.status_code for r in rs]
    print(f"\nsaturation: {codes.count(200)}/{n} ok, {len(samples)} health samples, "
          f"slow probes {[e['slow_probes'] for e in after['engines'].values()]}")
    assert codes.count(200) == n, codes
    assert all(len(s) == 2 for s in samples), samples
    assert all(e["downs"] == before["engines"][k]["downs"]
               for k, e in after["engines"].items())


def test_index_mode_switches_live_and_predicts_from_its_own_source(server, reset, tokenizer):
    """`predicted` (the router's own LRU guess) and back to `events`, on the running router:
    each mode serves a multi-turn run whose later turns find their history."""
    limit = health(server)["limits"]["max_inflight"]
    try:
        for mode in ("predicted", "events"):
            r = httpx.post(f"{server}/admin/reset", json={"policy": "affinity", "index": mode},
                           timeout=60)
            assert r.status_code == 200 and r.json()["index"] == mode, r.text
            assert health(server)["index"] == mode
            wl = multi_turn(conversations=4, turns=3, shared_systems=4, system_words=120,
                            seed=21 if mode == "predicted" else 22)
            res, _ = asyncio.run(run_workload(server, MODEL, wl, concurrency=4))
            later = [x for x in res if x.turn > 0]
            assert all(x.status == 200 for x in res)
            assert all(x.cached_tokens > 0 for x in later), [x.cached_tokens for x in later]
        bad = httpx.post(f"{server}/admin/reset", json={"index": "guess"}, timeout=60)
        assert bad.status_code == 400 and "index" in bad.text, bad.text
        assert health(server)["index"] == "events"
        # Other router settings ride on a reset (a benchmark's variants), validated first.
        bad = httpx.post(f"{server}/admin/reset", json={"settings": {"max_inflight": -1}},
                         timeout=60)
        assert bad.status_code == 400 and "max_inflight" in bad.text, bad.text
        assert health(server)["limits"]["max_inflight"] == limit
        r = httpx.post(f"{server}/admin/reset", json={"settings": {"max_inflight": limit + 7}},
                       timeout=60)
        assert r.status_code == 200 and health(server)["limits"]["max_inflight"] == limit + 7
        assert health(server)["index"] == "events"
    finally:
        httpx.post(f"{server}/admin/reset", json={"index": "events",
                                                  "settings": {"max_inflight": limit}},
                   timeout=60)


BURST = 12


def test_cache_pressure_admission_holds_requests_in_the_router(server, reset):
    """router.kv_admission as shipped (auto), live, with the engines' KV cache made tiny for
    admission (a set kv_admission_fill, a cap in every mode): each engine runs one request
    at a time, the others wait in the router (counted in /health) and are all served.
    /health says the router's share of the caches and its live window.
    Switched off, or with the engines' real caches (the same burst fits them), nothing is
    held."""
    def chat(tag: str, i: int) -> dict:
        # A system message of its own: no prompt shares a cached block with another, so
        # each adds all of its tokens to the budget.
        return {"model": MODEL, "max_tokens": 8, "messages": [
            {"role": "system", "content": f"{tag}-{i}: answer briefly."},
            {"role": "user", "content": f"Say {tag} {i} twice."}]}

    async def burst(tag: str) -> list[int]:
        async with httpx.AsyncClient(timeout=120) as c:
            rs = await asyncio.gather(*(c.post(
                f"{server}/v1/chat/completions", headers={"x-session-id": f"{tag}{i}"},
                json=chat(tag, i)) for i in range(BURST)))
        return [r.status_code for r in rs]

    def held_in(tag: str, settings: dict) -> int:
        r = httpx.post(f"{server}/admin/reset", json={"settings": settings}, timeout=60)
        assert r.status_code == 200, r.text
        before = health(server)["counts"]["kv_held"]
        assert asyncio.run(burst(tag)) == [200] * BURST
        return health(server)["counts"]["kv_held"] - before

    reset("affinity")
    names = ("kv_admission", "kv_admission_fill", "conversation_idle_s")
    shipped = {k: router_default(k) for k in names}
    assert shipped["kv_admission"] == "auto"
    # A budget of 1.5 requests per engine: one fits by itself, two do not (a request
    # bigger than the budget would not wait at all). The router budgets its share of each
    # cache: another router that sent requests in the last minute (an earlier test's)
    # halves it.
    probe = httpx.post(f"{server}/v1/chat/completions", json=chat("probe", 0), timeout=120)
    assert probe.status_code == 200, probe.text
    need = probe.json()["usage"]["prompt_tokens"] + 8
    h = health(server)
    cache = min(e["kv_blocks"] * e["block_size"] for e in h["engines"].values())
    share = h["admission"]["share"]
    assert 0 < share <= 1 and h["admission"]["window_s"] > 0, h["admission"]
    tiny = {**shipped, "kv_admission_fill": min(1.0, 1.5 * need / (cache * share)),
            "conversation_idle_s": 0.5}
    try:
        held = held_in("on", tiny)
        # Twelve at once, two engines, one running on each (up to three if another
        # router's last request ages out of this one's count meanwhile: its share doubles).
        assert held >= BURST - 6, held
        assert held_in("off", {**tiny, "kv_admission": False}) == 0
        assert held_in("fits", shipped) == 0
    finally:
        httpx.post(f"{server}/admin/reset", json={"settings": shipped}, timeout=60)


def router_default(name: str) -> object:
    from rayattn.config.schema import RouterConfig

    return RouterConfig.model_fields[name].default
