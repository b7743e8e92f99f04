"""The engine deployment's Serve request router delivers a call to the replica it names,
and publishes Serve's replica list to the rayattn router (the integration tests run it
for real: tests/integration/test_operations.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from rayattn.server.fleet.pinning import Membership, PinnedRequestRouter


def _replica(name: str) -> SimpleNamespace:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name))


def _choose(target, replicas):
    router = PinnedRequestRouter.__new__(PinnedRequestRouter)  # choose needs no state
    pending = SimpleNamespace(args=[target] if target is not None else [],
                              routing_context=SimpleNamespace(should_backoff=False))
    out = asyncio.run(router.choose_replicas(replicas, pending))
    # Serve retries a full target without pause unless told to back off.
    assert pending.routing_context.should_backoff
    return out


def test_a_named_replica_gets_the_call_and_only_it():
    a, b, c = _replica("a"), _replica("b"), _replica("c")
    assert _choose("b", [a, b, c]) == [[b]]
    # Gone (left, or replaced): any replica, which refuses it as Misrouted, so the router
    # re-routes instead of the call waiting for a replica that will not come back.
    assert _choose("gone", [a, b, c]) == [[a, b, c]]
    assert _choose(None, [a, b]) == [[a, b]]  # unpinned (e.g. /v1/models): any


def test_membership_reaches_late_and_early_listeners_on_their_loop():
    async def main() -> list[list[str]]:
        heard: list[list[str]] = []
        Membership.publish("app", "engine-test", ["a", "b"])
        Membership.subscribe("app", "engine-test", heard.append)
        await asyncio.sleep(0)
        Membership.publish("app", "engine-test", ["b", "c"])
        await asyncio.sleep(0)
        return heard

    assert asyncio.run(main()) == [["a", "b"], ["b", "c"]]


def test_a_refused_call_counts_as_a_gone_replica_bare_or_wrapped_by_ray():
    from rayattn.engine.protocol import Misrouted
    from rayattn.server.fleet.replica_set import engine_dead

    assert engine_dead(Misrouted("x"))
    assert engine_dead(SimpleNamespace(cause=Misrouted("x")))  # RayTaskError's `cause`
    assert not engine_dead(ValueError("bad request"))
