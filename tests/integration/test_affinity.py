"""Affinity routing on real engines: multi-turn hit rate vs the oracle, balance, and exact
per-request placement under concurrency."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from rayattn.bench.driver import oracle, run_workload, summarize
from rayattn.bench.workloads import multi_turn, shared_prefix

pytestmark = pytest.mark.integration
MODEL = "smollm2"
BLOCK = 32


@pytest.fixture(scope="module")
def tokenizer(server):
    from transformers import AutoTokenizer

    from rayattn.models.embedded import resolve_embedded

    return AutoTokenizer.from_pretrained(str(resolve_embedded("rayattn://smollm2-135m")))


def test_multi_turn_hit_rate_near_oracle_and_balanced(server, reset, tokenizer):
    wl = multi_turn(conversations=8, turns=4, shared_systems=2, seed=1)
    reset("affinity")
    res, wall = asyncio.run(run_workload(server, MODEL, wl, concurrency=4))
    s = summarize(res, wall)
    o = oracle(res, wl, tokenizer, BLOCK)
    print(f"\naffinity: {s} oracle: {o}")
    assert s["ok"] == wl.num_requests == 32
    assert s["hit_rate"] >= 0.9 * o["oracle_block_hit_rate"]
    assert s["max_replica_share"] <= 0.6

    reset("round_robin")
    res_rr, wall_rr = asyncio.run(run_workload(server, MODEL, wl, concurrency=4))
    rr = summarize(res_rr, wall_rr)
    print(f"round_robin: {rr}")
    assert rr["ok"] == 32
    assert rr["hit_rate"] < s["hit_rate"]


def test_affinity_is_exact_per_request_under_concurrency(server, reset):
    """32 concurrent follow-ups of 4 warmed prefixes: every request routed for affinity is
    served by the replica the router chose, and that replica really had the prefix."""
    reset("affinity")
    wl = shared_prefix(groups=4, prompts_per_group=9, system_words=250, seed=3)
    warm = [c for c in wl.conversations if c.session.endswith("-p0")]
    rest = [c for c in wl.conversations if not c.session.endswith("-p0")]

    async def send(c, client):
        r = await client.post(f"{server}/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": c.system},
                         {"role": "user", "content": c.turns[0]}]})
        assert r.status_code == 200, r.text
        return r

    async def go():
        async with httpx.AsyncClient(timeout=300) as client:
            for c in warm:
                await send(c, client)
            return await asyncio.gather(*(send(c, client) for c in rest))

    rs = asyncio.run(go())
    assert len(rs) == 32
    pids = {n: e["pid"] for n, e in
            httpx.get(f"{server}/health", timeout=30).json()["engines"].items()}
    hits = [r.json() for r in rs if r.json()["rayattn"]["route_reason"] == "affinity_hit"]
    assert len(hits) >= 16
    for body in hits:
        ext = body["rayattn"]
        # Served where routed: the engine process that answered (its own report, not the
        # router's) is the replica the router chose...
        assert ext["served_by"]["engine"] == ext["replica"]
        assert ext["served_by"]["pid"] == pids[ext["replica"]]
        # ...and it really held the predicted prefix.
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
            ext["predicted_cached_tokens"] - BLOCK > 0
