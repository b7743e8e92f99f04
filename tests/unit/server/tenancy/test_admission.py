"""Per-key admission, rates and turns for engine slots (server/tenancy/admission.py), without
Ray: one key's flood must not starve another's requests."""

from __future__ import annotations

import asyncio

import pytest

from rayattn.config.schema import RouterConfig
from rayattn.server.errors import APIError
from rayattn.server.tenancy.admission import Admission, FairQueue, RateLimits
from rayattn.server.tenancy.gates import Gates


def test_a_key_under_its_share_is_admitted_past_the_router_limit():
    adm = Admission(10)
    greedy = [adm.acquire("greedy") for _ in range(10)]
    with pytest.raises(APIError) as e:
        adm.acquire("greedy")
    assert e.value.status == 429 and "router.max_inflight" in e.value.message
    light = [adm.acquire("light") for _ in range(5)]  # its share: 10 over 2 keys
    with pytest.raises(APIError):
        adm.acquire("light")
    assert adm.inflight == 15
    for s in greedy + light:
        s.release()
    assert adm.inflight == 0 and not adm.by_key


def test_shares_never_take_the_router_past_twice_its_limit():
    # Keys arriving one after another, each taking all its share allows: without the
    # ceiling the total grows as the limit times the harmonic number of the keys.
    adm = Admission(100)
    for k in range(10):
        try:
            while True:
                adm.acquire(f"key-{k}")
        except APIError:
            pass
    assert 100 < adm.inflight <= 200


def test_admission_counts_the_engine_requests_a_request_asks_for():
    from rayattn.server.tenancy.field_limits import engine_requests

    assert engine_requests("chat", {"n": 4}) == 4
    assert engine_requests("completion", {"prompt": ["a", "b", "c"], "n": 2}) == 6
    assert engine_requests("completion", {"prompt": [1, 2, 3]}) == 1  # one token prompt
    adm = Admission(8)
    adm.acquire("k", 8)
    with pytest.raises(APIError):
        adm.acquire("k", 1)


def test_rate_limit_per_key_with_a_seconds_burst():
    now = [0.0]
    rates = RateLimits(2.0, clock=lambda: now[0])
    rates.take("a")
    rates.take("a")
    with pytest.raises(APIError) as e:
        rates.take("a")
    assert e.value.status == 429 and e.value.retry_after == 1
    rates.take("b")  # another key has its own bucket
    now[0] = 0.5
    rates.take("a")
    RateLimits(None).take("a")  # off


def test_a_freed_slot_goes_to_the_key_with_the_fewest_on_the_engines():
    async def scenario() -> list[str]:
        q = FairQueue()
        order: list[str] = []
        slots = 3  # the engines' capacity for this router, all taken by the greedy key
        for _ in range(3):
            q.started("greedy")

        async def request(key: str) -> None:
            # As the dispatcher does: an open slot, and this request's turn.
            ticket = q.ticket()
            while not (sum(q.dispatched.values()) < slots and q.may_go(key, ticket)):
                await q.wait(key, ticket)
            q.started(key)
            order.append(key)

        waiting = [asyncio.create_task(request("greedy")) for _ in range(3)]
        await asyncio.sleep(0.01)
        light = asyncio.create_task(request("light"))  # arrives last
        await asyncio.sleep(0.01)
        assert order == []  # no slot is free
        q.ended("greedy")
        await asyncio.sleep(0.01)
        assert order == ["light"]  # it went ahead of the greedy key's earlier requests
        for _ in range(3):
            q.ended("greedy")
            await asyncio.sleep(0.01)
        await asyncio.gather(*waiting, light)
        return order

    assert asyncio.run(scenario()) == ["light", "greedy", "greedy", "greedy"]


def test_a_key_at_its_cap_waits_while_others_go():
    async def scenario() -> None:
        q = FairQueue(key_cap=2)
        q.started("greedy")
        q.started("greedy")
        t = q.ticket()
        assert not q.may_go("greedy", t)
        assert q.may_go("light", q.ticket())
        woken = asyncio.create_task(q.wait("greedy", t))
        await asyncio.sleep(0.01)
        q.ended("greedy")  # its own request ended: its next one is woken
        await asyncio.wait_for(woken, 0.2)
        assert q.may_go("greedy", t) and q.waiting == 0

    asyncio.run(scenario())


def test_a_new_limit_starts_the_peak_again_from_what_is_admitted():
    gates = Gates.of(RouterConfig(max_inflight=8))
    slots = [gates.admission.acquire() for _ in range(6)]
    for s in slots[2:]:
        s.release()
    assert gates.counts()["admitted_peak"] == 6
    gates.apply(RouterConfig(max_inflight=8))  # other settings: the peak stands
    assert gates.counts()["admitted_peak"] == 6
    gates.apply(RouterConfig(max_inflight=4))
    assert gates.counts()["admitted_peak"] == 2  # the two still admitted
    gates.admission.acquire()
    assert gates.counts()["admitted_peak"] == 3
