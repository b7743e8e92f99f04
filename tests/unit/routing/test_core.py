"""The routing core's request lifecycle, without Ray: what the ingress and the simulator
both walk through (rayattn/routing/core.py)."""

from __future__ import annotations

import pytest

from rayattn.config.schema import RouterConfig
from rayattn.routing.core import Finished, RoutingCore

BS = 16


def core(**settings) -> RoutingCore:
    c = RoutingCore(RouterConfig(index="predicted", **settings).routing_settings(), BS)
    for name in ("a", "b"):
        assert c.joined(name, BS, 1000)
    return c


def prompt(n_blocks: int, salt: int = 0) -> list[int]:
    return [salt * 100_000 + i for i in range(n_blocks * BS + 3)]


def test_a_finished_request_teaches_the_index_its_continuation():
    c = core()
    ids = prompt(4)
    route = c.request(ids, session="s")
    d = c.choose(route, ["a", "b"])
    c.dispatched(d, route)
    assert c.load.inflight[d.replica] == 1
    assert c.load.pending_prefill[d.replica] == route.prompt_tokens
    c.first_token(d)
    assert c.load.pending_prefill[d.replica] == 0
    out = list(range(900, 900 + 2 * BS + 1))
    c.finished(d, route, Finished(len(ids), 0, out, {}))
    c.ended(d)
    assert c.load.inflight[d.replica] == 0
    # The next turn (prompt + answer + new text) is predicted cached on the same replica,
    # up to the blocks the engine really holds (the answer's last token was never computed).
    nxt = c.request(ids + out + [7] * 40, session="s")
    d2 = c.choose(nxt, ["a", "b"])
    assert d2.replica == d.replica
    assert d2.predicted_cached_tokens == (len(ids) + len(out) - 1) // BS * BS


def test_vllms_cached_token_rule_never_counts_the_last_token():
    c = core()
    route = c.request(list(range(2 * BS)))  # exactly two blocks
    c.index.insert("a", route.keys)
    d = c.choose(route, ["a"])
    assert d.predicted_cached_tokens == BS  # not 2 × BS - 1, not 2 × BS


def test_a_failed_attempt_releases_its_load_and_the_retry_goes_elsewhere():
    c = core()
    route = c.request(prompt(3))
    first = c.choose(route, ["a", "b"])
    c.dispatched(first, route)
    # The replica died before any output: the attempt ends without a first token.
    c.ended(first)
    assert c.load.inflight[first.replica] == 0
    assert c.load.pending_prefill[first.replica] == 0
    other = "b" if first.replica == "a" else "a"
    retry = c.choose(route, [other])  # the dispatcher offers the untried replicas
    c.dispatched(retry, route)
    c.first_token(retry)
    c.finished(retry, route, Finished(route.prompt_tokens, 0, [1, 2], {}))
    c.ended(retry)
    assert c.load.inflight[other] == 0
    assert c.index.match(route.keys).get(other) == len(route.keys)


def test_ended_twice_releases_once():
    c = core()
    route = c.request(prompt(2))
    d = c.choose(route, ["a"])
    c.dispatched(d, route)
    e = c.choose(route, ["a"])
    c.dispatched(e, route)
    c.ended(d)
    c.ended(d)  # two cleanup paths of one attempt must not release another request's load
    assert c.load.inflight["a"] == 1
    assert c.load.pending_prefill["a"] == e.uncached_tokens


def test_a_replica_that_leaves_mid_request_does_not_reenter_the_index():
    c = core()
    route = c.request(prompt(3))
    d = c.choose(route, ["a", "b"])
    c.dispatched(d, route)
    c.left(d.replica)
    c.first_token(d)
    c.finished(d, route, Finished(route.prompt_tokens, 0, [1, 2, 3], {
        "scheduled_ts": 1.0, "first_token_ts": 1.5, "itl_s": 0.01}))
    c.ended(d)
    assert d.replica not in c.policy.cost._spans  # its speed was not learned either
    assert d.replica not in c.routable
    assert d.replica not in c.index.replicas
    assert d.replica not in c.load.local  # nothing left of it once its last call ended
    assert d.replica not in c.snapshot().routable


def test_engine_load_reports_apply_only_to_routable_replicas():
    c = core()
    c.reported("a", {"other-router": 5})
    c.reported("gone", {"other-router": 9})
    assert c.load.inflight["a"] == 5
    assert c.load.inflight["gone"] == 0


def test_observe_refits_the_cost_model_through_the_lifecycle():
    c = core(prefill_s_per_token=1e-3)
    before = c.policy.cost.prefill_s_per_token
    for k in range(4):
        route = c.request(prompt(20, salt=k + 1))
        d = c.choose(route, ["a"])
        c.dispatched(d, route)
        c.first_token(d)
        # 323 tokens computed in 32 ms on the engine's clock: 1e-4 s per token.
        c.finished(d, route, Finished(route.prompt_tokens, 0, [5, 6], {
            "scheduled_ts": 10.0 * k, "first_token_ts": 10.0 * k + 0.0323, "itl_s": 0.01}))
        c.ended(d)
    assert c.policy.cost.prefill_s_per_token == pytest.approx(1e-4, rel=0.01)
    assert before == 1e-3


def test_reconfigure_rebuilds_only_on_a_setting_the_policy_reads():
    c = core()
    pol = c.policy
    assert not c.reconfigure(RouterConfig(index="predicted", max_inflight=7,
                                          ray_prefix_imbalanced_threshold=3).routing_settings())
    assert c.policy is pol  # not one of affinity's settings: what it learned stays
    c.reconfigure(RouterConfig(index="predicted", load_slack=9).routing_settings())
    assert c.policy is not pol and c.policy.slack == 9
    assert c.reconfigure(c.settings.replace(index="events"))  # the caller re-feeds
    assert c.settings.index == "events" and set(c.index.replicas) == {"a", "b"}


def test_block_size_from_the_first_engine_and_mismatches_refused():
    c = RoutingCore(RouterConfig().routing_settings(), 32)
    assert c.joined("a", BS, 100) and c.block_size == BS
    assert not c.joined("b", 32, 100)
    assert "b" not in c.routable


def test_unknown_policy_names_the_registered_ones():
    with pytest.raises(ValueError, match="affinity, round_robin"):
        RoutingCore(RouterConfig().routing_settings().replace(policy="nope"), BS)


def test_regret_and_moves_are_counted_by_reason():
    c = core(policy="round_robin")
    ids = prompt(6)
    first = c.request(ids, session="conv")
    d1 = c.choose(first, ["a", "b"])
    c.dispatched(d1, first)
    c.first_token(d1)
    c.finished(d1, first, Finished(len(ids), 0, [1, 2], {}))
    c.ended(d1)
    # round_robin sends the next turn to the other replica: a move, and every block the
    # first replica held is recomputed there.
    nxt = c.request(ids + [1, 2] + [9] * 40, session="conv")
    d2 = c.choose(nxt, ["a", "b"])
    assert d2.replica != d1.replica and d2.moved_from == d1.replica
    assert d2.regret_tokens == 6 * BS
    snap = c.snapshot()
    assert snap.session_moves == {"round_robin": 1}
    assert snap.regret_tokens == {"round_robin": 6 * BS}


def test_sticky_keeps_a_conversation_home_and_places_new_ones_least_loaded():
    c = core(policy="sticky")
    busy = c.request(prompt(2, salt=7), session="other")
    c.dispatched(c.choose(busy, ["a"]), busy)  # "a" carries one request
    route = c.request(prompt(3), session="s")
    d = c.choose(route, ["a", "b"])
    assert d.replica == "b" and d.reason == "cold"
    c.dispatched(c.choose(c.request(prompt(2, salt=8), session="x"), ["b"]),
                 c.request(prompt(2, salt=8)))
    c.dispatched(c.choose(c.request(prompt(2, salt=9), session="y"), ["b"]),
                 c.request(prompt(2, salt=9)))
    again = c.choose(c.request(prompt(4), session="s"), ["a", "b"])
    assert again.replica == "b" and again.reason == "session"  # home, though busier


def test_engines_sharing_a_device_share_their_queue():
    c = RoutingCore(RouterConfig(index="predicted").routing_settings(), BS)
    for name in ("a", "b"):
        assert c.joined(name, BS, 1000, device="GPU-0")
    home = c.request(prompt(60), session="s")
    c.index.insert("a", home.keys)  # the conversation's history is on "a"
    # A burst of cold prompts queued on "a" only: on separate devices this would move the
    # conversation to "b"; on one device "b" waits behind the same GPU.
    for k in range(8):
        cold = c.request(prompt(100, salt=k + 1))
        c.dispatched(c.choose(cold, ["a"]), cold)
    d = c.choose(home, ["a", "b"])
    assert d.replica == "a" and d.moved_from is None

    apart = RoutingCore(RouterConfig(index="predicted").routing_settings(), BS)
    for name, dev in (("a", "GPU-0"), ("b", "GPU-1")):
        assert apart.joined(name, BS, 1000, device=dev)
    apart.index.insert("a", home.keys)
    for k in range(8):
        cold = apart.request(prompt(100, salt=k + 1))
        apart.dispatched(apart.choose(cold, ["a"]), cold)
    assert apart.choose(home, ["a", "b"]).replica == "b"


def test_a_conversations_next_turn_hashes_only_its_new_blocks():
    c = core()
    fresh = core()
    turn1 = prompt(10)
    r1 = c.request(turn1, session="s")
    assert c.keys.hashed_blocks == 10
    d = c.choose(r1, ["a"])
    c.dispatched(d, r1)
    answer = list(range(500, 500 + 3 * BS))
    c.finished(d, r1, Finished(len(turn1), 0, answer, {}))
    c.ended(d)
    turn2 = turn1 + answer + [7] * (4 * BS)
    before = c.keys.hashed_blocks
    r2 = c.request(turn2, session="s")
    # The answer's blocks were hashed when the first turn finished: only the new user text.
    assert c.keys.hashed_blocks - before == 4
    assert r2.keys == fresh.request(turn2).keys  # exactly what hashing from scratch gives
    # A history edited in its 4th block: the first three blocks are reused, no more.
    edited = list(turn2)
    edited[3 * BS + 1] = 99_999
    before = c.keys.hashed_blocks
    r3 = c.request(edited, session="s")
    assert r3.keys == fresh.request(edited).keys
    assert c.keys.hashed_blocks - before == len(edited) // BS - 3
