"""The query-of-death quarantine (routing/quarantine.py) and how the dispatcher classes an
engine replica's failure (server/fleet/replica_set.py)."""

from __future__ import annotations

import pytest
from ray import exceptions as ray_exc

from rayattn.engine.protocol import EngineDown, Misrouted
from rayattn.routing.core import RoutingCore
from rayattn.routing.quarantine import CAPACITY, Quarantine, fingerprint
from rayattn.server.fleet.replica_set import failure

BS = 16


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def core() -> RoutingCore:
    from rayattn.config.schema import RouterConfig

    return RoutingCore(RouterConfig().routing_settings(), BS)


def test_fingerprint_tells_prompts_apart_by_any_token(core):
    base = list(range(1, 60))
    same = fingerprint(core.request(list(base)), BS)
    assert fingerprint(core.request(list(base)), BS) == same
    for i in (0, 20, 58):  # in the first block, a middle block, the partial last block
        other = list(base)
        other[i] += 1
        assert fingerprint(core.request(other), BS) != same, i
    assert fingerprint(core.request(base + [7]), BS) != same


def test_a_prompt_is_refused_after_crashing_n_engines_for_the_hold_time():
    clock = Clock()
    q = Quarantine(after=2, hold_s=60, clock=clock)
    assert q.failed(1, "e0") == 1 and q.refused_for(1) == 0  # an innocent bystander, once
    # Two copies on the engine that crashed are one crash, not two.
    assert q.failed(1, "e0") == 1 and q.refused_for(1) == 0
    assert q.failed(1, "e1") == 2 and q.refused_for(1) == pytest.approx(60)
    assert q.refused_for(2) == 0
    clock.now += 59
    assert q.refused_for(1) == pytest.approx(1)
    clock.now += 2
    assert q.refused_for(1) == 0
    # A quarantine served in full starts the count again.
    assert q.failed(1, "e2") == 1 and q.refused_for(1) == 0


def test_zero_never_refuses_and_memory_is_bounded():
    q = Quarantine(after=0, hold_s=60)
    for e in range(5):
        q.failed(9, f"e{e}")
    assert q.refused_for(9) == 0
    q = Quarantine(after=1, hold_s=60)
    for p in range(CAPACITY + 100):
        q.failed(p, "e0")
    assert len(q) == CAPACITY
    assert q.refused_for(0) == 0 and q.refused_for(CAPACITY + 99) > 0  # oldest forgotten


def test_one_tenant_cannot_get_anothers_prompt_refused(core):
    short = core.request([5, 6, 7])  # shorter than a block: nothing salted in its keys
    assert fingerprint(short, BS, "tenant-a") != fingerprint(short, BS, "tenant-b")


def test_failures_are_classed_by_whether_the_request_can_be_their_cause():
    from vllm.v1.engine.exceptions import EngineDeadError

    assert failure(ValueError("bad request")) == "request"
    assert failure(Misrouted("left")) == "never_ran"
    assert failure(EngineDown("dead before the call")) == "never_ran"
    assert failure(ray_exc.ActorDiedError()) == "replica_died"
    assert failure(EngineDeadError()) == "engine_crashed"
    # As Ray delivers an exception a replica raised: a RayTaskError that is also the cause.
    wrapped = ray_exc.RayTaskError("serve", "tb", EngineDown("x")).as_instanceof_cause()
    assert failure(wrapped) == "never_ran"
    crashed = ray_exc.RayTaskError("serve", "tb", EngineDeadError()).as_instanceof_cause()
    assert failure(crashed) == "engine_crashed"
