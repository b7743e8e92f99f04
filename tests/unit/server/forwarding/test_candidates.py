"""Which targets a request may go to, and its waits, against a fake fleet: no engine, an
engine not up yet, every engine at its cap, an adapter only some engines run, a pinned
home."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from rayattn.routing.kv_budget import KVBudget
from rayattn.routing.policies import RouteRequest
from rayattn.server.errors import APIError
from rayattn.server.forwarding.candidates import Candidates
from rayattn.server.tenancy.admission import FairQueue


class Fleet:
    def __init__(self, live: list[str], members: list[str] | None = None,
                 adapters: dict[str, set[str]] | None = None) -> None:
        self.up = live
        self.members = {m: object() for m in (members if members is not None else live)}
        self.adapters = adapters or {}

    def live_targets(self) -> list[str]:
        return list(self.up)

    def serving(self, adapter: str, among: list[str]) -> list[str]:
        return [t for t in among if adapter in self.adapters.get(t, set())]


def make(fleet: Fleet, cap: int = 2) -> tuple[Candidates, SimpleNamespace, list[int]]:
    core = SimpleNamespace(settings=SimpleNamespace(kv_admission=False),
                           load=SimpleNamespace(local={}), kv=KVBudget())
    rejected: list[int] = []
    return Candidates(core, fleet, FairQueue(), lambda: cap, rejected.append,
                      {"kv_held": 0, "kv_held_s": 0.0}), core, rejected


def route(**kw) -> RouteRequest:
    r = RouteRequest(keys=[], prompt_tokens=3, affinity_key=0, token_ids=[1, 2, 3])
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def get(c: Candidates, r: RouteRequest, tried: set[str] | None = None,
        grace_s: float = 0.0) -> list[str]:
    return asyncio.run(c.get(r, tried or set(), time.monotonic() + grace_s, ("", 0)))


def test_no_engine_at_all_is_a_503_at_once_and_counted():
    c, _, rejected = make(Fleet([]))
    with pytest.raises(APIError) as e:
        get(c, route())
    assert e.value.status == 503 and rejected == [503]


def test_engines_not_up_yet_are_waited_for_within_the_grace():
    """Not as a request queued behind load: a stream waiting for an engine to come up keeps
    its real answer (requests.py commits only queued ones)."""
    fleet = Fleet([], members=["e1"])
    c, _, _ = make(fleet)
    r, seen = route(), []

    async def go() -> list[str]:
        loop = asyncio.get_running_loop()
        loop.call_later(0.1, lambda: seen.append(r.queued))
        loop.call_later(0.2, fleet.up.append, "e1")
        return await c.get(r, set(), time.monotonic() + 5, ("", 0))

    assert asyncio.run(go()) == ["e1"]
    assert seen == [False]


def test_untried_targets_below_the_cap_come_first():
    c, core, _ = make(Fleet(["e1", "e2", "e3"]), cap=2)
    core.load.local.update(e1=2, e2=1)
    assert get(c, route(), tried={"e3"}) == ["e2"]  # e1 at its cap, e3 tried
    assert get(c, route(), tried={"e1", "e2", "e3"}) == ["e2", "e3"]  # all tried: any open


def test_a_request_waits_while_every_target_is_at_its_cap_until_one_frees():
    c, core, _ = make(Fleet(["e1"]), cap=1)
    core.load.local["e1"] = 1

    async def go() -> tuple[list[str], float]:
        def free() -> None:
            core.load.local["e1"] = 0
            c.fair.wake_all()
        t0 = time.monotonic()
        asyncio.get_running_loop().call_later(0.2, free)
        got = await c.get(route(), set(), time.monotonic(), ("", c.fair.ticket()))
        return got, time.monotonic() - t0

    got, waited = asyncio.run(go())
    assert got == ["e1"] and waited >= 0.2


def test_a_request_waiting_for_an_engine_slot_is_queued_until_it_has_one():
    c, core, _ = make(Fleet(["e1"]), cap=1)
    core.load.local["e1"] = 1
    r, seen = route(), []

    async def go() -> list[str]:
        def free() -> None:
            core.load.local["e1"] = 0
            c.fair.wake_all()
        loop = asyncio.get_running_loop()
        loop.call_later(0.1, lambda: seen.append(r.queued))
        loop.call_later(0.2, free)
        return await c.get(r, set(), time.monotonic(), ("", c.fair.ticket()))

    assert asyncio.run(go()) == ["e1"]
    assert seen == [True] and r.queued is False


def test_an_adapter_goes_only_where_it_is_loaded_and_is_a_404_where_nowhere():
    c, _, _ = make(Fleet(["e1", "e2"], adapters={"e2": {"poet"}}))
    assert get(c, route(adapter="poet")) == ["e2"]
    with pytest.raises(APIError) as e:
        get(c, route(adapter="pirate"))
    assert e.value.status == 404 and e.value.param == "model"


def test_a_pinned_continuation_goes_home_or_is_a_404_naming_the_field():
    c, _, _ = make(Fleet(["e1", "e2"]))
    assert get(c, route(pinned="e2")) == ["e2"]
    c, _, _ = make(Fleet(["e1"], members=["e1"]))
    with pytest.raises(APIError) as e:
        get(c, route(pinned="e2"))
    assert e.value.status == 404 and e.value.param == "previous_response_id"


def test_a_new_conversation_held_for_kv_room_is_not_passed_by_a_later_one():
    """Cache-pressure admission: a new conversation that fits does not take the room one
    that came before it waits for (a big one would otherwise wait for its timeout while
    smaller ones keep fitting); it goes once the earlier one has gone."""

    room = {"big": [], "small": ["e0"]}
    core = SimpleNamespace(settings=SimpleNamespace(kv_admission="auto"),
                           load=SimpleNamespace(local={}), kv=KVBudget(idle_s=5.0),
                           kv_room=lambda r, candidates: room[r.session])
    c = Candidates(core, Fleet(["e0"]), FairQueue(), lambda: 10, [].append,
                   {"kv_held": 0, "kv_held_s": 0.0})

    async def main() -> None:
        big = asyncio.create_task(c.get(route(session="big"), set(), time.monotonic(),
                                        ("", 0)))
        await asyncio.sleep(0.05)
        small = asyncio.create_task(c.get(route(session="small"), set(), time.monotonic(),
                                          ("", 0)))
        await asyncio.sleep(0.05)
        assert not big.done() and not small.done()  # small fits, but big came first
        room["big"] = ["e0"]
        c.released()
        assert await asyncio.wait_for(big, 2) == ["e0"]
        assert await asyncio.wait_for(small, 2) == ["e0"]

    asyncio.run(main())
