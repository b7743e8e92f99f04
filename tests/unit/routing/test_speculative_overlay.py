"""SpeculativeOverlay alone: blocks counted where they were sent until the engine speaks."""

from __future__ import annotations

from rayattn.routing.speculative_overlay import SpeculativeOverlay


def _nobody(key: int) -> set[str] | None:
    return None


def test_a_sent_block_counts_until_its_ttl_and_expired_ones_go():
    now = [0.0]
    o = SpeculativeOverlay(5.0, lambda: now[0])
    o.insert("a", [1, 2], _nobody)
    assert o.owners(1, None) == {"a"} and o.owners(1, {"b"}) == {"a", "b"}
    now[0] = 6.0
    assert o.owners(1, None) == set()  # expired: dropped as it is looked at
    assert o.owners(1, None) is None
    assert o.count("a") == 1  # key 2 not looked at nor swept yet
    o.insert("b", [9], _nobody)  # an insert sweeps what expired
    assert o.count("a") == 0 and o.count("b") == 1


def test_a_block_the_engine_already_holds_there_gets_no_overlay():
    o = SpeculativeOverlay(5.0, lambda: 0.0)
    o.insert("a", [1, 2], lambda k: {"a"} if k == 1 else None)
    assert o.count("a") == 1 and o.owners(1, {"a"}) == {"a"}


def test_a_renewed_block_outlives_its_first_expiry():
    now = [0.0]
    o = SpeculativeOverlay(5.0, lambda: now[0])
    o.insert("a", [1], _nobody)
    now[0] = 4.0
    o.insert("a", [1], _nobody)
    now[0] = 6.0
    o.insert("b", [2], _nobody)  # sweeps the first entry, which was renewed
    assert o.owners(1, None) == {"a"}


def test_drop_and_forget():
    o = SpeculativeOverlay(5.0, lambda: 0.0)
    o.insert("a", [1, 2], _nobody)
    o.insert("b", [1], _nobody)
    o.drop(1, "a")
    assert o.owners(1, None) == {"b"}
    o.forget("b")
    assert o.count("b") == 0 and o.owners(1, None) is None and o.count("a") == 1


def test_ttl_applies_to_blocks_sent_from_then_on():
    now = [0.0]
    o = SpeculativeOverlay(5.0, lambda: now[0])
    o.insert("a", [1], _nobody)
    o.ttl_s = 100.0
    o.insert("a", [2], _nobody)
    now[0] = 50.0
    assert o.owners(1, None) == set() and o.owners(2, None) == {"a"}
