"""Routing policies on a fake fleet (pure routing logic; real engines in tests/integration)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rayattn.config.schema import RouterConfig
from rayattn.routing import policies
from rayattn.routing.load import LoadTracker
from rayattn.routing.policies import PolicyContext, RouteRequest, rendezvous_rank
from rayattn.routing.policies.affinity import AffinityParams
from rayattn.routing.prefix_index import PrefixIndex

BS = 16


def fleet(n: int, policy: str = "affinity", eps: float = 0.5, cap: int = 10_000,
          slack: int = 0):
    idx, load = PrefixIndex(), LoadTracker()
    names = [f"r{i}" for i in range(n)]
    for r in names:
        idx.add_replica(r, cap)
    pol = policies.build(policy, PolicyContext(idx, load, BS, seed=0),
                         RouterConfig(load_epsilon=eps, load_slack=slack).routing_settings()
                         .params(policy))
    return pol, idx, load, names


def req(keys, tokens=None, session=None):
    return RouteRequest(keys, tokens or len(keys) * BS + 5, keys[0] if keys else 0, session)


def test_affinity_follows_the_cache():
    pol, idx, load, names = fleet(4)
    idx.insert("r2", [1, 2, 3, 4])
    d = pol.choose(req([1, 2, 3, 4, 5]), names)
    assert d.replica == "r2" and d.reason == "affinity_hit"
    assert d.predicted_cached_tokens == 4 * BS


def test_bounded_load_guard_diverts_from_hot_replica():
    pol, idx, load, names = fleet(2, eps=0.25)
    idx.insert("r0", [1, 2, 3, 4])
    for _ in range(6):
        load.acquire("r0", 0)
    d = pol.choose(req([1, 2, 3, 4, 5]), names)
    assert d.replica == "r1" and d.reason == "load_guard"


HISTORY = list(range(1, 61))  # a conversation's 60 cached blocks, all on r0


def busy_holder(in_flight: int, **load_facts: dict[str, object]):
    """Two replicas, the conversation's history on r0 and `in_flight` requests there."""
    pol, idx, load, names = fleet(2, eps=0.25)
    for attr, values in load_facts.items():
        getattr(load, attr).update(values)
    idx.insert("r0", HISTORY)
    for _ in range(in_flight):
        load.acquire("r0", 0)
    return pol, load, names


def test_no_guard_move_while_the_holder_has_room_in_its_batch():
    # 6 in flight against 0 trips the guard above; with engines that batch 32 requests
    # the request joins r0's running batch and keeps its (long) cached history.
    pol, load, names = busy_holder(6, batch={"r0": 32, "r1": 32})
    d = pol.choose(req(HISTORY + [99]), names)
    assert d.replica == "r0" and d.reason != "load_guard"
    for _ in range(26):  # r0's batch is full: now the guard moves it
        load.acquire("r0", 0)
    assert pol.choose(req(HISTORY + [99]), names).reason == "load_guard"


def test_engines_on_one_gpu_are_one_unit_for_the_guard():
    # Moving the conversation to the other engine on the same GPU frees nothing.
    pol, _, names = busy_holder(40, device={"r0": "GPU-0", "r1": "GPU-0"})
    d = pol.choose(req(HISTORY + [99]), names)
    assert d.replica == "r0" and d.reason != "load_guard"
    # On separate GPUs the same load does move it.
    pol, _, names = busy_holder(40, device={"r0": "GPU-0", "r1": "GPU-1"})
    assert pol.choose(req(HISTORY + [99]), names).reason == "load_guard"


def test_a_new_session_leaves_a_shared_head_for_a_free_batch_beside_it():
    """Two engines on one GPU, an agent's shared prompt cached on r0 only, r0 past its own
    batch (requests there queue in its engine) while r1 has free places: a new session of
    that agent goes to r1 and prefills the prompt there once (a run of such sessions
    otherwise piles onto r0: 65 % of them on one H100). Under its batch r0 keeps them."""
    head = list(range(2001, 2021))  # the agent's prompt, 20 blocks
    pol, load, names = busy_holder(7, batch={"r0": 8, "r1": 8},
                                   device={"r0": "GPU-0", "r1": "GPU-0"})
    pol.index.insert("r0", head)
    new_session = RouteRequest(head + [5000], (len(head) + 1) * BS, head[0], "s-new",
                               max_tokens=32)
    assert pol.choose(new_session, names).replica == "r0"  # the 8th place is free
    for _ in range(3):  # 10 in flight on r0: this request would wait for 3 places
        load.acquire("r0", 0)
    d = pol.choose(new_session, names)
    assert d.replica == "r1" and d.reason == "batch_wait"
    # A conversation whose own long history is on r0 still stays: the wait for a place
    # costs less than recomputing it.
    history = list(range(3001, 3241))  # 240 blocks
    pol.index.insert("r0", history)
    own = RouteRequest(history + [9], (len(history) + 1) * BS, history[0], "s-old",
                       max_tokens=32)
    assert pol.choose(own, names).replica == "r0"
    # Without a batch reported there is no place to wait for.
    load.batch.clear()
    assert pol.choose(new_session, names).replica == "r0"


def test_the_wait_for_a_place_is_priced_by_the_output_requests_run_to():
    """max_tokens is a cap (256 where the client sends none): the wait for a place counts
    the output requests actually ran to, so a conversation is not moved off its history for
    a wait its engine's requests would not make it take; where the wait does outweigh the
    recompute, the move says so (`batch_wait`)."""
    history = list(range(3001, 3121))  # 120 blocks of its own history on r0
    pol, load, names = busy_holder(10, batch={"r0": 8, "r1": 8},
                                   device={"r0": "GPU-0", "r1": "GPU-0"})
    pol.index.insert("r0", history)
    own = RouteRequest(history + [9], (len(history) + 1) * BS, history[0], "s-old")
    assert own.max_tokens == 256  # no max_tokens sent
    # Nothing measured yet: the cap stands in, and 3 places of 256 steps outweigh the
    # recompute of 1.9k tokens.
    d = pol.choose(own, names)
    assert d.replica == "r1" and d.reason == "batch_wait"
    for _ in range(20):  # requests that ran to 16 tokens
        pol.observe("r0", 0, {}, 10, 16)
    d = pol.choose(own, names)
    assert d.replica == "r0" and d.reason == "affinity_hit"


def test_past_every_batch_a_shorter_queue_does_not_move_a_conversation():
    """Both engines past their batch: the conversation stays with its history although a
    place there costs more than its recompute (a place seated sooner on the other engine is
    one seated later for the next request there). Once the other engine has a free place,
    the same queue moves it (`batch_wait`), and the guard still moves it off a hot spot."""
    history = list(range(3001, 3121))  # 120 blocks of its own history on r0
    pol, load, names = busy_holder(10, batch={"r0": 8, "r1": 8})
    pol.index.insert("r0", history)
    own = RouteRequest(history + [9], (len(history) + 1) * BS, history[0], "s-old")
    for _ in range(9):  # r1 past its batch too: 2 places to wait for against r0's 3
        load.acquire("r1", 0)
    d = pol.choose(own, names)
    assert d.replica == "r0" and d.reason == "affinity_hit"
    for _ in range(2):  # r1 under its batch: no place to wait for there
        load.release("r1", 0)
    d = pol.choose(own, names)
    assert d.replica == "r1" and d.reason == "batch_wait"
    for _ in range(4):  # r0 at 14 against 7: past the guard's bound
        load.acquire("r0", 0)
    assert pol.choose(own, names).reason == "load_guard"


@pytest.mark.parametrize("weigh", [False, True])
def test_past_every_batch_queued_prefill_work_does_not_move_a_conversation(weigh):
    """Both engines past their batch, the conversation's engine with far more prefill work
    queued: it stays with its history (the shorter queue is shorter only until the next
    request joins it), unless router.weigh_queues_past_batch counts the queues there. Once
    the other engine has a free place, the queued work counts again and moves it. New
    conversations, holding as much on either engine, still go where less is queued."""
    history = list(range(3001, 3121))  # 120 blocks of its own history on r0
    idx, load = PrefixIndex(), LoadTracker()
    names = ["r0", "r1"]
    for r in names:
        idx.add_replica(r, 10_000)
    load.batch.update({"r0": 8, "r1": 8})
    pol = policies.build("affinity", PolicyContext(idx, load, BS, seed=0),
                         RouterConfig(weigh_queues_past_batch=weigh).routing_settings()
                         .params("affinity"))
    idx.insert("r0", history)
    own = RouteRequest(history + [9], (len(history) + 1) * BS, history[0], "s-old")
    for _ in range(9):  # each past its batch of 8, by the same count
        load.acquire("r0", 40 * len(history) * BS)  # 40 × the history's prefill queued
        load.acquire("r1", 0)
    d = pol.choose(own, names)
    assert (d.replica, d.reason) == (("r1", "cold") if weigh else ("r0", "affinity_hit"))
    # A new conversation holds as much on either engine (nothing, or one shared prompt):
    # no recompute to trade, so it still goes where less is queued.
    shared = history[:10]
    idx.insert("r1", shared)
    for k in range(8):  # (rendezvous among equals would put about half on r0)
        assert pol.choose(req([7000 + k, 7100 + k]), names).replica == "r1"
        assert pol.choose(req(shared + [5000 + k, 5100 + k]), names).replica == "r1"
    for _ in range(2):  # r1 under its batch: the queue ahead of it counts again
        load.release("r1", 0)
    assert pol.choose(own, names).replica == "r1"


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 16), st.floats(0.0, 1.0), st.integers(0, 2**32))
@example(11, 0.32, 0)  # (1+ε)·m is exactly 3 at one step: the float order decides the cap
def test_bounded_load_property(n, eps, seed):
    """Whatever the cache says, no replica is ever pushed past ceil((1+ε)·mean) in-flight."""
    pol, idx, load, names = fleet(n, eps=eps)
    rng = random.Random(seed)
    hot = [1, 2, 3, 4]
    idx.insert("r0", hot)  # everything wants r0
    for _ in range(5 * n):
        total = sum(load.inflight[r] for r in names)
        # In the guard's own float order: at an exact boundary ((1+ε)·m a whole number)
        # (1+ε)·(total+1)/n and (1+ε)·((total+1)/n) may round to either side of it.
        cap = math.ceil((1 + eps) * ((total + 1) / n))
        d = pol.choose(req(hot + [rng.randrange(10**6)]), names)
        assert load.inflight[d.replica] + 1 <= cap
        load.acquire(d.replica, 0)
        if rng.random() < 0.3:  # some complete
            busy = [r for r in names if load.inflight[r]]
            load.release(rng.choice(busy))


def test_cold_prefix_followers_converge_deterministically():
    """Followers of a prefix, each dispatched and completed in turn (state changing between
    them), all land where the first went; a second router that never saw any of them picks
    the same replica for the cold prefix (multi-ingress)."""
    pol, idx, load, names = fleet(8)
    chosen = []
    for i in range(5):
        r = req([777, 1, 1000 + i])
        d = pol.choose(r, names)
        pol.on_dispatch(d.replica, r)
        load.acquire(d.replica, r.prompt_tokens)
        load.release(d.replica, r.prompt_tokens)
        pol.on_complete(d.replica, r.keys)
        chosen.append(d.replica)
    assert len(set(chosen)) == 1
    pol2, *_ = fleet(8)
    assert pol2.choose(req([777, 1, 5]), names).replica == chosen[0]
    # Another cold prefix is not forced onto the same replica: rendezvous spreads them.
    firsts = {pol2.choose(req([k, 1]), names).replica for k in range(100, 140)}
    assert len(firsts) >= 6


def test_rehoming_moves_only_the_dead_replicas_prefixes():
    names = [f"r{i}" for i in range(16)]
    keys = list(range(500))
    before = {k: rendezvous_rank(k, names)[0] for k in keys}
    survivors = [n for n in names if n != "r3"]
    after = {k: rendezvous_rank(k, survivors)[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "r3" for k in moved)


def test_replica_removed_loses_entries_and_new_replica_starts_empty():
    pol, idx, load, names = fleet(3)
    idx.insert("r1", [5, 6, 7])
    idx.remove_replica("r1")
    pol.forget_replica("r1")
    live = ["r0", "r2"]
    d = pol.choose(req([5, 6, 7, 8]), live)
    assert d.replica in live and d.reason == "cold"
    idx.add_replica("r9", 100)
    assert idx.size("r9") == 0


def test_session_breaks_ties():
    pol, idx, load, names = fleet(4)
    first = pol.choose(req([], tokens=10, session="s1"), names).replica
    # A different (cold) prompt of the same session stays with its previous replica (the
    # routing core tells the policy where that was).
    other = RouteRequest([], 12, affinity_key=424242, session="s1")
    assert pol.choose(other, names).replica != first  # the key alone ranks another first
    other.previous = first
    d = pol.choose(other, names)
    assert d.replica == first and d.reason == "session"


def test_round_robin_and_power_of_two_spread():
    pol, idx, load, names = fleet(3, "round_robin")
    assert [pol.choose(req([1]), names).replica for _ in range(6)] == names * 2
    pol, idx, load, names = fleet(2, "power_of_two")
    load.acquire("r0", 0)
    assert pol.choose(req([1]), names).replica == "r1"


def test_ray_prefix_policy_uses_text_and_falls_back_when_imbalanced():
    pol, idx, load, names = fleet(2, "ray_prefix")
    r = RouteRequest([], 10, 0, None, text="You are a helpful assistant. Question one")
    first = pol.choose(r, names)
    pol.on_dispatch(first.replica, r)
    r2 = RouteRequest([], 10, 0, None, text="You are a helpful assistant. Question two")
    assert pol.choose(r2, names).replica == first.replica
    for _ in range(20):
        load.acquire(first.replica, 0)
    assert pol.choose(r2, names).reason == "power_of_two"


def test_cost_model_measures_prefill_throughput_over_overlapping_requests():
    pol, *_ = fleet(2)
    # 8 prompts batched together on one engine: 8 × 1000 tokens in 4 s of engine time, and
    # every request's own span covers all 4 s (so does that of a 50-token cache hit).
    for _ in range(8):
        pol.cost.observe_prefill("e0", 100.0, 104.0, 1000)
    pol.cost.observe_prefill("e0", 100.0, 104.0, 50)
    assert pol.cost.prefill_s_per_token == pytest.approx(4.0 / 8050)
    # A slower engine, measured on its own clock, busy 1 s in every 2 (idle gaps are not
    # prefill time): the fleet takes the upper median engine's rate, of two the slower.
    for i in range(4):
        pol.cost.observe_prefill("e1", 7.0 + 2 * i, 8.0 + 2 * i, 250)
    assert pol.cost.prefill_s_per_token == pytest.approx(4.0 / 1000)
    # The slower engine leaves: its rate leaves the median with it.
    pol.forget_replica("e1")
    assert pol.cost.prefill_s_per_token == pytest.approx(4.0 / 8050)


def test_a_move_must_pay_for_the_prefill_it_adds():
    """A conversation's home holds its 1.6k-token history; the other replica holds only the
    shared 1k-token system prompt and 7 ms less queued. Counting the recompute once, the move
    looks cheaper (7.1 vs 8.9 ms); counted also as work put before the queue, it is not."""
    pol, idx, load, names = fleet(2)
    pol.cost.prefill_s_per_token, pol.cost.ctx_s_per_token = 1e-5, 1e-6
    pol.cost.decode_s_per_request = 1e-4
    system, history = list(range(1, 65)), list(range(100, 136))
    idx.insert("r0", system + history)
    idx.insert("r1", system)
    load.acquire("r0", 700)  # queued prefill: 7 ms at home, none on r1
    load.acquire("r1", 0)
    d = pol.choose(req(system + history + [999]), names)
    assert d.replica == "r0"
    # Without the home's history the move is right: the other replica is chosen.
    pol2, idx2, load2, _ = fleet(2)
    pol2.cost.prefill_s_per_token, pol2.cost.ctx_s_per_token = 1e-5, 1e-6
    pol2.cost.decode_s_per_request = 1e-4
    idx2.insert("r0", system)
    idx2.insert("r1", system)
    load2.acquire("r0", 700)
    load2.acquire("r1", 0)
    assert pol2.choose(req(system + history + [999]), names).replica == "r1"


def test_load_slack_keeps_a_conversation_home_at_low_load():
    """At a run's tail (7 vs 1 in flight) the ε bound alone (⌈1.5 × 4.5⌉ = 7) would move the
    conversation off its cache; with the slack the replica may carry mean + 4."""
    for slack, expected in ((0, "r1"), (4, "r0")):
        pol, idx, load, names = fleet(2, slack=slack)
        history = list(range(1, 101))  # a 1.6k-token conversation cached on r0
        idx.insert("r0", history)
        for _ in range(7):
            load.acquire("r0", 0)
        load.acquire("r1", 0)
        assert pol.choose(req(history + [101]), names).replica == expected


def test_cold_conversations_sharing_a_short_head_spread():
    """New conversations whose prompts share only their first block (chat-template head)
    spread by the block where they differ instead of all tie-breaking to one replica."""
    pol, idx, load, names = fleet(4)
    head = 999
    chosen = []
    for i in range(40):  # 20-block first turns whose first block is the shared head
        r = req([head] + [10_000 * i + b for b in range(19)])
        d = pol.choose(r, names)
        pol.on_dispatch(d.replica, r)
        pol.on_complete(d.replica, r.keys)
        chosen.append(d.replica)
    assert len(set(chosen)) == 4
    assert max(chosen.count(n) for n in names) <= 20


def test_load_is_exact_for_own_requests_and_reported_for_other_routers():
    load = LoadTracker(origin="me")
    # The engine counts every router's requests; ours come from our own bookkeeping.
    load.reported("r0", {"other": 5, "me": 3})
    assert load.inflight["r0"] == 5
    load.acquire("r0", 100)
    assert load.inflight["r0"] == 6
    assert load.pending_prefill["r0"] == 100
    load.reported("r0", {"other": 5, "me": 1})  # a report that already includes ours
    assert load.inflight["r0"] == 6
    load.release("r0", 100)
    # Finished while the report that counted it was on its way: no phantom load remains.
    assert load.inflight["r0"] == 5
    assert load.pending_prefill["r0"] == 0
    load.reported("r0", {"other": 2})
    assert load.inflight["r0"] == 2
    load.acquire("r0", 10)
    load.forget("r0")  # marked down (e.g. a transient RPC error) while ours still runs
    assert load.inflight["r0"] == 1  # the other routers' report is gone, ours is not
    load.release("r0", 10)  # the running call ends and releases exactly once
    assert load.inflight["r0"] == 0 and load.pending_prefill.get("r0", 0) == 0
    # A replica that left keeps no entry once its last call ended (replicas come and go).
    assert "r0" not in load.local and "r0" not in load.pending_prefill
    assert [r for r, _ in load.inflight.items()] == []


def test_the_newest_load_report_wins_whatever_order_reports_arrive_in():
    load = LoadTracker(origin="me")
    load.reported("r0", {"other": 7}, (100, 12))  # a request's final chunk
    load.reported("r0", {"other": 0}, (100, 9))  # a probe reply taken earlier, arriving late
    assert load.inflight["r0"] == 7
    load.reported("r0", {}, (200, 1))  # a new engine process starts its own counter
    assert load.inflight["r0"] == 0


def test_admission_is_exact():
    from rayattn.server.errors import APIError
    from rayattn.server.tenancy.admission import Admission

    adm = Admission(3)
    slots = [adm.acquire() for _ in range(3)]
    try:
        adm.acquire()
        raise AssertionError("admitted past the limit")
    except APIError as e:
        assert e.status == 429
    # A slot released twice (response end and error path both firing) frees one place only.
    slots[0].release()
    slots[0].release()
    assert adm.inflight == 2
    adm.acquire()
    try:
        adm.acquire()
        raise AssertionError("a double release let a fourth request in")
    except APIError:
        pass
    assert adm.peak == 3


def tiered_fleet():
    from rayattn.routing.prefix_index import EventIndex

    idx, load = EventIndex(), LoadTracker()
    for r in ("r0", "r1", "r2"):
        idx.add_replica(r)
    pol = policies.build("affinity", PolicyContext(idx, load, BS, seed=0), AffinityParams())
    pol.cost.prefill_s_per_token, pol.cost.ctx_s_per_token = 1e-5, 1e-7
    pol.cost.decode_s_per_request = 1e-4
    return pol, idx, load


def test_a_history_in_the_host_tier_keeps_its_conversation():
    """A conversation's 1.6k-token history left r0's HBM but sits in r0's host tier: r0
    reloads it for a tenth of a prefill, so 7 ms of queue there does not justify recomputing
    it elsewhere. Without the tier in the index, the same conversation moves."""
    history = list(range(1, 101))
    for tiered, expected in ((True, "r0"), (False, "r1")):
        pol, idx, load = tiered_fleet()
        if tiered:
            idx.stored("r0", history, "cpu")
        load.acquire("r0", 700)
        route = req(history + [101])
        route.held, route.reloaded = idx.match_tiers(route.keys)
        d = pol.choose(route, ["r0", "r1"])
        assert d.replica == expected


def test_hbm_beats_host_tier_beats_cold():
    pol, idx, load = tiered_fleet()
    history = list(range(1, 101))
    idx.stored("r0", history)  # in HBM
    idx.stored("r1", history[:10])  # head in HBM, the rest reloaded from host memory
    idx.stored("r1", history[10:], "cpu")
    route = req(history + [101])
    route.held, route.reloaded = idx.match_tiers(route.keys)
    assert route.held == {"r0": 100, "r1": 100} and route.reloaded == {"r1": 90}
    d = pol.choose(route, ["r0", "r1", "r2"])
    assert d.replica == "r0"
    # The reload is priced at reload_cost_fraction of a prefill, between the two.
    assert d.costs["r0"] < d.costs["r1"] < d.costs["r2"]
    assert d.costs["r1"] - d.costs["r0"] == pytest.approx(90 * BS * 1e-5 * 0.1)
    assert pol.reloaded_tokens(route, "r1") == 90 * BS and pol.reloaded_tokens(route, "r0") == 0


def test_past_every_batch_the_work_not_the_block_count_decides():
    """Both engines past their batch: one more block on r0, but all of it to reload from
    host memory, costs more than r1's HBM copy of the rest and one block's recompute, so
    the conversation stays on r1."""
    pol, idx, load = tiered_fleet()
    history = list(range(1, 102))
    idx.stored("r0", history, "cpu")
    idx.stored("r1", history[:100])
    load.batch.update({"r0": 2, "r1": 2})
    for _ in range(3):
        load.acquire("r0", 0)
        load.acquire("r1", 0)
    route = req(history + [102])
    route.held, route.reloaded = idx.match_tiers(route.keys)
    assert route.held == {"r0": 101, "r1": 100}
    assert pol.choose(route, ["r0", "r1"]).replica == "r1"


def test_new_conversations_fill_engines_sharing_a_gpu_evenly():
    """Two engines on one GPU share its compute (the cost ties them) but not their KV caches:
    new conversations, each with a document of its own, alternate between them instead of
    splitting by hash."""
    pol, idx, load, names = fleet(2)
    load.device.update({"r0": "gpu0", "r1": "gpu0"})
    for i in range(128):  # by hash alone these split 68/60
        r = req([50_000 * i + b for b in range(100)])
        d = pol.choose(r, names)
        assert d.reason == "cold"
        pol.on_dispatch(d.replica, r)
        load.acquire(d.replica, r.prompt_tokens)
    assert load.inflight["r0"] == load.inflight["r1"] == 64


def test_the_ray_prefix_text_tree_stays_bounded_and_keeps_what_is_used():
    """Issue 25, item 9: the ray_prefix tree grew with every distinct prompt. Now it evicts
    least recently used text past its limit, as Ray's does."""
    from rayattn.routing.text_tree import TextPrefixTree

    tree = TextPrefixTree(max_chars=10_000, target_chars=8_000)
    hot = "You are the assistant everyone keeps asking. " * 4
    for i in range(2_000):
        tree.insert(f"cold prompt {i}: " + "x" * 50, "a")
        tree.insert(hot + f"question {i % 3}", "b")
        assert tree.chars <= 10_000
    assert tree.longest_match(hot + "question 1", {"a", "b"}) == (len(hot) + 10, {"b"})
    assert tree.longest_match("cold prompt 5: " + "x" * 50, {"a"})[0] < 20  # long gone
    # The count is the edges' true size.
    size, stack = 0, [tree.root]
    while stack:
        n = stack.pop()
        for label, child in n.children.values():
            size += len(label)
            stack.append(child)
    assert size == tree.chars


def test_several_routers_fill_engines_sharing_a_gpu_evenly_on_stale_reports():
    """Four routers place new conversations at once; what each hears of the others' load is
    one engine's report fresh and the other's late (reports ride on the first chunk of
    requests that started at different times). Each router balances its own placements, so
    the sum over routers stays even whatever the reports say."""
    routers = []
    for k in range(4):
        idx, load = PrefixIndex(), LoadTracker(origin=f"o{k}")
        for r in ("r0", "r1"):
            idx.add_replica(r, 10_000)
            load.device[r] = "gpu0"
        routers.append((policies.build("affinity", PolicyContext(idx, load, BS, seed=0),
                                       AffinityParams()), load))
    truth = {"r0": {f"o{k}": 0 for k in range(4)}, "r1": {f"o{k}": 0 for k in range(4)}}
    late = dict(truth["r1"])
    for i in range(128):
        k = i % 4
        pol, load = routers[k]
        r = req([50_000 * i + b for b in range(100)])
        d = pol.choose(r, ["r0", "r1"])
        pol.on_dispatch(d.replica, r)
        load.acquire(d.replica, r.prompt_tokens)
        truth[d.replica][f"o{k}"] += 1
        if i % 16 == 15:
            late = dict(truth["r1"])
        for _, other in routers:
            other.reported("r0", truth["r0"])
            other.reported("r1", late)
    split = {r: sum(n.values()) for r, n in truth.items()}
    assert abs(split["r0"] - split["r1"]) <= 4, split


def test_across_gpus_a_new_conversation_weighs_every_routers_load():
    """Engines on separate GPUs: another router's reported load counts (only between the
    engines of one GPU does this router's own count come first)."""
    pol, idx, load, names = fleet(2)
    load.device.update({"r0": "gpu0", "r1": "gpu1"})
    load.origin = "me"
    for _ in range(2):
        load.acquire("r0", 0)  # decoding: no prefill queued
    load.reported("r1", {"other": 3})  # within the cost's tolerance: the tie-break decides
    d = pol.choose(req([7_000_000 + b for b in range(100)]), names)
    assert d.reason == "cold" and d.replica == "r0"
