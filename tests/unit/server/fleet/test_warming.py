"""Warming (server/fleet/warming.py) on a fake engine handle (no Ray): a joining replica is
held out of routing until its prefills are done, a leaving one's conversations are prefilled
where their next turns go, and a setting switched off does neither."""

from __future__ import annotations

import asyncio
from typing import Any

from rayattn.config.schema import RouterConfig
from rayattn.routing.core import Finished, RoutingCore
from rayattn.server.fleet.replica_set import Replica
from rayattn.server.fleet.warming import Warming

BS = 16
SYSTEM = list(range(1, 3 * BS + 1))


class Handle:
    """An engine replica's `prefill`, recorded; each call waits for `gate`."""

    def __init__(self, name: str, calls: list[tuple[str, list[int]]],
                 gate: asyncio.Event) -> None:
        self.name, self.calls, self.gate = name, calls, gate
        self.prefill = self

    def remote(self, token_ids: list[int], rank: int | None, salt: str | None) -> Any:
        async def run() -> int:
            await self.gate.wait()
            self.calls.append((self.name, token_ids))
            return 0
        return run()


def _fleet(enabled: bool = True) -> tuple[RoutingCore, dict[str, Replica], Warming,
                                          list[tuple[str, list[int]]], asyncio.Event]:
    core = RoutingCore(RouterConfig(index="predicted").routing_settings(), BS)
    calls: list[tuple[str, list[int]]] = []
    gate = asyncio.Event()
    members = {n: Replica(n, Handle(n, calls, gate), up=True) for n in ("a", "b")}
    for n in members:
        assert core.joined(n, BS, 1000)
    for i in range(3):  # three conversations on "a", sharing a system prompt
        route = core.request(SYSTEM + [100 + i] * 40, session=f"s{i}")
        d = core.choose(route, ["a"])
        core.dispatched(d, route)
        core.finished(d, route, Finished(route.prompt_tokens, 0, [7, 7], {}))
        core.ended(d)
    warming = Warming(core, lambda: members,
                      lambda: [n for n, r in members.items() if r.up
                               and n not in warming.warming],
                      lambda: enabled, lambda: 5.0, {}, lambda: None)
    return core, members, warming, calls, gate


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def test_a_joining_replica_is_routed_to_once_its_shared_prefixes_are_prefilled():
    async def run() -> None:
        core, members, warming, calls, gate = _fleet()
        new = members["c"] = Replica("c", Handle("c", calls, gate))
        assert core.joined("c", BS, 1000)
        warming.joined(new, ["c"])
        new.up = True
        assert warming.warming == {"c"}  # held while its prefill runs
        gate.set()
        await _settle()
        assert warming.warming == set()
        assert calls == [("c", SYSTEM)]
        assert warming.counts["warm_prefills"] == 1 and warming.counts["warm_tokens"] == 48

    asyncio.run(run())


def test_a_leaving_replicas_conversations_are_prefilled_on_the_one_that_stays():
    async def run() -> None:
        core, members, warming, calls, gate = _fleet()
        members["a"].up = False
        warming.leaving(["a"])
        core.left("a")
        gate.set()
        await _settle()
        # The most recent first, each its last prompt and answer (but the last token).
        assert [(n, ids[-41:-1]) for n, ids in calls] == [
            ("b", [102] * 40), ("b", [101] * 40), ("b", [100] * 40)]
        assert warming.counts["moved_conversations"] == 3
        assert core.decisions.previous("s0") == "b"

    asyncio.run(run())


def test_switched_off_nothing_is_held_or_sent():
    async def run() -> None:
        core, members, warming, calls, gate = _fleet(enabled=False)
        new = members["c"] = Replica("c", Handle("c", calls, gate))
        assert core.joined("c", BS, 1000)
        warming.joined(new, ["c"])
        members["a"].up = False
        warming.leaving(["a"])
        gate.set()
        await _settle()
        assert warming.warming == set() and calls == []

    asyncio.run(run())
