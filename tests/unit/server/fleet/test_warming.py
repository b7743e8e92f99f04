"""Warming (server/fleet/warming.py) on a fake engine handle (no Ray): a joining replica is
held out of routing until its prefills are done, a leaving one's conversations are prefilled
where their next turns go, and a setting switched off does neither."""

from __future__ import annotations

import asyncio
import types
from typing import Any

from rayattn.config.schema import RouterConfig
from rayattn.routing.core import Finished, RoutingCore
from rayattn.server.fleet.replica_set import Replica
from rayattn.server.fleet.warming import Warming

BS = 16
SYSTEM = list(range(1, 3 * BS + 1))


class Response:
    """Serve's response to one call: awaitable, cancellable."""

    def __init__(self, run: Any) -> None:
        self._run, self.cancelled = run, False

    def __await__(self) -> Any:
        return self._run.__await__()

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    """An engine replica's `prefill`, recorded; each call waits for `gate`."""

    def __init__(self, name: str, calls: list[tuple[str, list[int]]],
                 gate: asyncio.Event) -> None:
        self.name, self.calls, self.gate = name, calls, gate
        self.prefill = self
        self.responses: list[Response] = []

    def remote(self, token_ids: list[int], rank: int | None, salt: str | None) -> Response:
        async def run() -> int:
            await self.gate.wait()
            self.calls.append((self.name, token_ids))
            return 0
        self.responses.append(Response(run()))
        return self.responses[-1]


def _fleet(enabled: bool = True, timeout_s: float = 5.0
           ) -> tuple[RoutingCore, dict[str, Replica], Warming, list[tuple[str, list[int]]],
                      asyncio.Event]:
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
    warming = Warming(core, lambda: members, lambda: [n for n, r in members.items() if r.up],
                      lambda: enabled, lambda: timeout_s, {}, lambda: None)
    return core, members, warming, calls, gate


async def _settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0)


def test_a_joining_replica_is_routed_to_once_its_shared_prefixes_are_prefilled():
    async def run() -> None:
        core, members, warming, calls, gate = _fleet()
        new = members["c"] = Replica("c", Handle("c", calls, gate))
        assert core.joined("c", BS, 1000)
        warming.joined(new, ["c"])
        new.up = True
        assert warming.holding == {"c"}  # held while its prefill runs
        assert warming.routable(["a", "b", "c"]) == ["a", "b"]
        # The others gone (a one-replica rolling update): it is not held from routing.
        assert warming.routable(["c"]) == ["c"]
        gate.set()
        await _settle()
        assert warming.holding == set()
        assert calls == [("c", SYSTEM)]
        assert warming.counts["warm_prefills"] == 1 and warming.counts["warm_tokens"] == 48

    asyncio.run(run())


def test_a_leaving_replicas_conversations_are_prefilled_on_the_one_that_stays():
    async def run() -> None:
        core, members, warming, calls, gate = _fleet()
        members["a"].up = False
        warming.leaving(members["a"], ["a"])
        core.left("a")
        gate.set()
        await _settle()
        # The most recent first, each its last prompt and answer (but the last token).
        assert [(n, ids[-41:-1]) for n, ids in calls] == [
            ("b", [102] * 40), ("b", [101] * 40), ("b", [100] * 40)]
        assert warming.counts["moved_conversations"] == 3
        assert core.decisions.previous("s0") == "b"

    asyncio.run(run())


def test_a_replica_that_comes_back_keeps_the_conversations_not_moved_yet():
    async def run() -> None:
        core, members, warming, calls, gate = _fleet()
        members["a"].up = False
        # Serve updating its config: out of the list for a moment
        warming.leaving(members["a"], ["a"])
        await _settle()  # the first move waits on the engine
        members["a"].up = True
        gate.set()
        await _settle()
        assert [n for n, _ in calls] == ["b"]
        assert warming.counts["moved_conversations"] == 1

    asyncio.run(run())


def test_switched_off_nothing_is_held_or_sent():
    async def run() -> None:
        core, members, warming, calls, gate = _fleet(enabled=False)
        new = members["c"] = Replica("c", Handle("c", calls, gate))
        assert core.joined("c", BS, 1000)
        warming.joined(new, ["c"])
        members["a"].up = False
        warming.leaving(members["a"], ["a"])
        gate.set()
        await _settle()
        assert warming.holding == set() and calls == []

    asyncio.run(run())


def test_a_prefill_that_takes_too_long_is_cancelled_and_the_replica_served_cold():
    async def run() -> None:
        core, members, warming, calls, gate = _fleet(timeout_s=0.05)
        new = members["c"] = Replica("c", Handle("c", calls, gate))
        assert core.joined("c", BS, 1000)
        warming.joined(new, ["c"])
        await asyncio.sleep(0.2)  # the gate never opens
        assert warming.holding == set() and calls == []
        assert [r.cancelled for r in new.handle.responses] == [True]

    asyncio.run(run())


def test_a_replica_back_under_the_same_engine_process_is_not_warmed():
    async def run() -> None:
        core, members, warming, calls, gate = _fleet()
        a = members["a"]
        a.pid, a.up = 7, False
        warming.leaving(a, ["a"])  # Serve updating its config
        back = Replica("a", a.handle, pid=7, info=types.SimpleNamespace(pid=7))
        warming.joined(back, ["a"])
        assert warming.holding == set()
        other = Replica("c", Handle("c", calls, gate), pid=8,
                        info=types.SimpleNamespace(pid=8))
        members["c"] = other
        assert core.joined("c", BS, 1000)
        warming.joined(other, ["c"])  # a new one is
        assert warming.holding == {"c"}
        gate.set()
        await _settle()

    asyncio.run(run())
