"""Where stored Responses answers live (rayattn/routing/response_homes.py)."""

from __future__ import annotations

from rayattn.routing.response_homes import ResponseHomes


def test_a_continuation_finds_its_home_until_the_oldest_are_forgotten():
    homes = ResponseHomes(capacity=3)
    for i in range(3):
        homes.stored(f"resp_{i}", "key-a", "smollm2", f"engine-{i % 2}")
    assert homes.home("resp_1") == ("key-a", "smollm2", "engine-1")
    homes.stored("resp_0", "key-a", "smollm2", "engine-0")  # touched again: the newest
    homes.stored("resp_3", "key-b", "tiny", "engine-9")     # evicts resp_1, the oldest
    assert homes.home("resp_1") is None
    assert homes.home("resp_0") == ("key-a", "smollm2", "engine-0")
    assert homes.home("resp_3").tenant == "key-b"
    assert homes.home("resp_unknown") is None
