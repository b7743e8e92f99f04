"""Cache-pressure-aware admission's bookkeeping (routing/kv_budget.py) and its place in the
routing core's request lifecycle, on a fake clock."""

from __future__ import annotations

from rayattn.config.schema import RouterConfig
from rayattn.routing.core import Finished, RoutingCore
from rayattn.routing.kv_budget import KVBudget


def test_live_histories_hold_new_conversations_back_until_they_go_quiet():
    now = [0.0]
    kv = KVBudget(idle_s=5.0, fill=1.0, clock=lambda: now[0])
    kv.joined("e0", 10_000)
    # Two conversations of 4k tokens each run a turn and finish: 8.2k tokens live.
    held = {s: kv.dispatched("e0", s, 4000, 100) for s in ("a", "b")}
    for s in ("a", "b"):
        kv.finished("e0", s, 4100)
        kv.ended("e0", s, held[s])
    assert kv.reserved["e0"] == 8200 and kv.running["e0"] == 0
    third = kv.dispatched("e0", "c", 1000, 100)  # a short one running meanwhile
    # A new 2k-token conversation would push a live history out: it waits...
    assert kv.room(["e0"], "d", 2000, 100) == []
    # ...while a's next turn adds only its new 500 tokens and output: it runs.
    assert kv.adds("e0", "a", 4600, 100) == 600 and kv.room(["e0"], "a", 4600, 100) == ["e0"]
    # Histories that outgrow the cache by themselves do not stop their own next turns.
    kv.finished("e0", "b", 9_000)
    assert kv.room(["e0"], "b", 9_500, 100) == ["e0"] and kv.room(["e0"], "d", 10, 1) == []
    kv.finished("e0", "b", 4100)
    assert kv.is_live("a") and not kv.is_live("d")
    now[0] = 6.0  # a and b went quiet (c is still running)
    assert kv.room(["e0"], "d", 2000, 100) == ["e0"]
    assert kv.reserved["e0"] == 1000 and not kv.is_live("a")
    kv.ended("e0", "c", third)
    # Nothing running: an engine takes anything, however big (no request waits forever).
    kv.dispatched("e0", "x", 9_000, 100)
    assert kv.room(["e0"], "y", 5_000, 100) == []
    assert KVBudget(5.0).room(["unknown"], "y", 50_000, 100) == ["unknown"]


def test_with_a_host_tier_only_histories_in_use_are_protected():
    now = [0.0]
    kv = KVBudget(idle_s=5.0, fill=1.0, clock=lambda: now[0])
    kv.joined("gpu", 10_000)
    kv.joined("host", 10_000, host_tier=True)
    for r in ("gpu", "host"):
        # a's turn is over (quiet, live), b's is in flight: 4k + 4k of histories.
        ha = kv.dispatched(r, f"a{r}", 4000, 100)
        kv.finished(r, f"a{r}", 4100)
        kv.ended(r, f"a{r}", ha)
        kv.dispatched(r, f"b{r}", 4000, 100)
    assert kv.active["host"] == 4000 and kv.reserved["host"] == 8100
    # Without a host tier the quiet history is protected: a 2k newcomer waits. With one,
    # the quiet history survives eviction in host memory: only b's in-flight history and
    # running output count, and the newcomer runs.
    assert kv.room(["gpu", "host"], "d", 2000, 100) == ["host"]
    # A prompt needs all of its blocks in HBM there, reloaded history included: a's next
    # turn (4.6k) fits next to b (4.1k), a 6k newcomer does not.
    assert kv.room(["host"], "ahost", 4600, 100) == ["host"]
    assert kv.room(["host"], "e", 6000, 100) == []
    # b's turn ends: its history is quiet too, and out of the protected set.
    kv.finished("host", "bhost", 4100)
    kv.ended("host", "bhost", 100)
    assert kv.active["host"] == 0 and kv.running["host"] == 0


def test_protect_live_keeps_the_strict_rule_on_a_host_tier_engine():
    kv = KVBudget(idle_s=5.0, fill=1.0, protect="live")
    kv.joined("host", 10_000, host_tier=True)
    h = kv.dispatched("host", "a", 4000, 100)
    kv.finished("host", "a", 4100)
    kv.ended("host", "a", h)
    kv.dispatched("host", "b", 4000, 100)
    # a's quiet history is protected like b's: a 2k newcomer waits (auto would admit it).
    assert kv.room(["host"], "d", 2000, 100) == []
    kv.protect = "auto"
    assert kv.room(["host"], "d", 2000, 100) == ["host"]


def test_a_live_conversation_waits_for_its_home_instead_of_moving():
    kv = KVBudget(idle_s=5.0, fill=1.0)
    for r in ("e0", "e1"):
        kv.joined(r, 10_000, host_tier=True)
    h = kv.dispatched("e0", "a", 3000, 64)
    kv.finished("e0", "a", 3064)
    kv.ended("e0", "a", h)
    kv.dispatched("e0", "b", 7000, 64)  # e0 is nearly full with b's turn
    # a's next turn does not fit next to b on e0; e1 has room but not a's history: it
    # waits for e0 (a newcomer takes e1)...
    assert kv.room(["e0", "e1"], "a", 3500, 64) == []
    assert kv.room(["e0", "e1"], "new", 3500, 64) == ["e1"]
    # ...unless e0 is not a candidate at all (it failed the turn, or left): then it moves.
    assert kv.room(["e1"], "a", 3500, 64) == ["e1"]


def test_a_conversation_moving_takes_its_history_along_and_a_leaving_engine_its_own():
    kv = KVBudget(idle_s=5.0)
    kv.joined("e0", 10_000)
    kv.joined("e1", 10_000)
    h = kv.dispatched("e0", "a", 3000, 64)
    kv.finished("e0", "a", 3064)
    kv.ended("e0", "a", h)
    # Its next turn on e1: nothing of it is held there, the whole prompt is new.
    assert kv.adds("e1", "a", 3500, 64) == 3564
    kv.dispatched("e1", "a", 3500, 64)
    assert kv.reserved["e0"] == 0 and kv.reserved["e1"] == 3500
    kv.left("e1")
    assert not kv.is_live("a") and "e1" not in kv.capacity


def test_core_lifecycle_keeps_the_budget():
    now = [0.0]
    core = RoutingCore(RouterConfig(index="predicted", kv_admission=True,
                                    conversation_idle_s=5.0,
                                    kv_admission_fill=0.95).routing_settings(), 16,
                       clock=lambda: now[0])
    assert core.joined("e0", 16, 500)  # 8,000 tokens
    assert core.kv.capacity == {"e0": 8000}
    route = core.request(list(range(3000)), session="s1")
    route.max_tokens = 100
    d = core.choose(route, ["e0"])
    core.dispatched(d, route)
    assert core.kv.running["e0"] == 100 and core.kv.reserved["e0"] == 3000
    core.finished(d, route, Finished(3000, 0, list(range(64))))
    core.ended(d)
    core.ended(d)  # a second cleanup path releases nothing twice
    assert core.kv.running["e0"] == 0 and core.kv.reserved["e0"] == 3064
    other = core.request(list(range(50_000, 56_000)), session="s2")
    other.max_tokens = 100
    blocker = core.request(list(range(90_000, 90_100)))
    b = core.choose(blocker, ["e0"])
    core.dispatched(b, blocker)  # something running: the budget applies
    assert core.kv_room(other, ["e0"]) == []  # 3,064 live + 6,100 > 8,000 × 0.95
    now[0] = 6.0
    assert core.kv_room(other, ["e0"]) == ["e0"]  # s1 went quiet
    core.reset()  # a cold start forgets conversations, keeps what is running
    assert core.kv.capacity == {"e0": 8000} and core.kv.running["e0"] == b.kv_held


def test_an_engine_that_leaves_and_rejoins_keeps_its_running_count_exact():
    kv = KVBudget(idle_s=5.0, fill=1.0)
    kv.joined("e0", 10_000)
    h = kv.dispatched("e0", "a", 3000, 64)
    s = kv.dispatched("e0", None, 500, 32)  # no session: its prompt runs too
    assert kv.running["e0"] == 64 + 532
    kv.left("e0")  # marked down while both run; they end afterwards
    kv.ended("e0", "a", h)
    kv.ended("e0", None, s)
    kv.joined("e0", 10_000)
    assert kv.running["e0"] == 0 and kv.reserved["e0"] == 0
    # Nothing running: an engine takes a big request (nothing waits forever), where one
    # running request would hold it back.
    assert kv.room(["e0"], "big", 9_800, 100) == ["e0"]
    kv.dispatched("e0", "small", 100, 10)
    assert kv.room(["e0"], "big", 9_800, 100) == []


def test_a_live_conversation_with_room_at_home_may_still_be_moved_by_the_policy():
    kv = KVBudget(idle_s=5.0, fill=1.0)
    for r in ("e0", "e1"):
        kv.joined(r, 10_000)
    h = kv.dispatched("e0", "a", 3000, 64)
    kv.finished("e0", "a", 3064)
    kv.ended("e0", "a", h)
    kv.dispatched("e1", "b", 1000, 64)
    assert kv.room(["e0", "e1"], "a", 3500, 64) == ["e0", "e1"]


def test_the_fill_backs_off_where_live_histories_are_lost_and_recovers_where_kept():
    """Admission judges newcomers on today's histories, which grow every turn: where live
    conversations come back to find what they continue evicted, the engine admits up to
    less; where they find it kept, the fill climbs back to the ceiling."""
    from rayattn.routing.kv_budget import FILL_BACKOFF, FILL_FLOOR

    now = [0.0]
    kv = KVBudget(idle_s=5.0, fill=0.9, clock=lambda: now[0])
    kv.joined("e0", 10_000)
    kv.joined("e1", 10_000)

    def turn(replica: str, session: str, continued: tuple[int, int] | None) -> None:
        h = kv.dispatched(replica, session, 2_000, 100, continued)
        kv.finished(replica, session, 2_100)
        kv.ended(replica, session, h)

    turn("e0", "a", (0, 0))  # a first turn teaches nothing
    assert kv.fill_of("e0") == 0.9
    turn("e0", "a", (2_000, 200))  # back home, 200 of the 2,000 it continues left: lost
    assert kv.fill_of("e0") == 0.9 * FILL_BACKOFF and kv.fill_of("e1") == 0.9
    # The lower fill is what admission applies: 1,000 running + 5,100 new + 2,100 live
    # fit 0.9 of 10k but not 0.81 of it (while something runs there).
    kv.dispatched("e0", None, 900, 100)
    assert kv.room(["e0"], "new", 5_000, 100) == []
    assert kv.room(["e0"], "new", 4_900, 100) == ["e0"]
    # A new ceiling applies at once, the back-off kept as a share of it.
    kv.fill = 1.0
    assert kv.fill_of("e0") == FILL_BACKOFF
    for continued in (None, (0, 0)):  # nothing to learn from: unchanged
        for _ in range(20):
            turn("e0", "a", continued)
    assert kv.fill_of("e0") == FILL_BACKOFF
    turn("e0", "a", (2_000, 1_000))  # half of it kept: not a loss
    assert kv.fill_of("e0") > FILL_BACKOFF
    for _ in range(100):
        turn("e0", "a", (2_000, 2_000))
    assert kv.fill_of("e0") == 1.0
    for _ in range(100):
        turn("e0", "a", (2_000, 0))
    assert kv.fill_of("e0") == FILL_FLOOR
    # Not a turn back home with nothing of it in flight: says nothing of either engine.
    turn("e1", "a", (2_000, 0))  # a moved
    kv.dispatched("e1", "a", 2_000, 100, (2_000, 2_000))  # a turn still running there...
    kv.dispatched("e1", "a", 2_000, 100, (2_000, 0))  # ...is not indexed yet
    assert kv.fill_of("e1") == 1.0
    now[0] = 100.0
    kv.dispatched("e1", "b", 2_000, 100, (2_000, 0))
    assert kv.fill_of("e1") == 1.0  # b is no live conversation here
    kv.fill = 0.1  # a ceiling under the floor is the floor
    assert kv.fill_of("e0") == 0.1
    kv.left("e0")
    kv.joined("e0", 10_000)
    assert kv.fill_of("e0") == 0.1


def test_the_core_learns_from_its_event_index_and_only_with_admission_on():
    from rayattn.routing.hashing import to_key
    from rayattn.routing.kv_budget import FILL_BACKOFF

    for admission in (True, False):
        now = [0.0]
        core = RoutingCore(RouterConfig(kv_admission=admission, kv_admission_fill=0.9,
                                        speculative_ttl_s=1.0).routing_settings(), 16,
                           clock=lambda now=now: now[0])
        core.joined("e0", 16, 5000)
        prompt = list(range(3000))
        for turn in range(3):
            route = core.request(prompt, session="s1")
            route.max_tokens = 64
            d = core.choose(route, ["e0"])
            core.dispatched(d, route)
            if turn == 2:
                break
            output = list(range(10_000, 10_064))
            core.finished(d, route, Finished(len(prompt), 0, output))
            core.ended(d)
            now[0] += 2.0  # past the speculative entries: the index is the engine's events
            cached = prompt + output[:-1]  # what vLLM caches: all but the last token's KV
            keys = [to_key(h) for h in core.keys.hasher.full_hashes(cached)]
            core.index.stored("e0", keys)
            if turn == 0:
                assert route.continued_tokens == 0
            else:  # turn 1 found turn 0's history: kept
                assert route.continued_tokens > 3000 and d.predicted_cached_tokens > 3000
                assert core.kv.fill_of("e0") == 0.9
                core.index.removed("e0", keys)  # evicted before turn 2
            prompt = cached + [1] + list(range(20_000, 20_100))
        # Turn 2 continues turn 1's history, which the engine evicted: with admission on,
        # a loss (the index followed the engine); off, nothing is learned.
        assert route.continued_tokens > 3000 and d.predicted_cached_tokens == 0
        assert core.snapshot().routable["e0"].admission_fill == \
            (0.9 * FILL_BACKOFF if admission else 0.9)
    # The predicted index guesses from the router's own traffic: nothing learned from it.
    predicted = RoutingCore(RouterConfig(index="predicted", kv_admission=True,
                                         kv_admission_fill=0.9).routing_settings(), 16)
    assert predicted.joined("e0", 16, 5000)
    route = predicted.request(list(range(3000)), session="s")
    d = predicted.choose(route, ["e0"])
    predicted.dispatched(d, route)
    predicted.finished(d, route, Finished(3000, 0, [1, 2]))
    predicted.ended(d)
    predicted.index.remove_replica("e0")
    predicted.index.add_replica("e0", 5000)
    route = predicted.request(list(range(3000)) + [1, 5, 6], session="s")
    d = predicted.choose(route, ["e0"])
    predicted.dispatched(d, route)
    assert route.continued_tokens > 0 and d.predicted_cached_tokens == 0
    assert predicted.kv.fill_of("e0") == 0.9


def test_unset_the_ceiling_is_lower_where_no_host_tier_keeps_evicted_histories():
    from rayattn.routing.kv_budget import HBM_FILL, HOST_TIER_FILL

    kv = KVBudget(idle_s=5.0)
    kv.joined("hbm", 10_000)
    kv.joined("host", 10_000, host_tier=True)
    assert (kv.fill_of("hbm"), kv.fill_of("host")) == (HBM_FILL, HOST_TIER_FILL)
    for r in ("hbm", "host"):
        kv.dispatched(r, None, 100, 100)  # something runs: the budget applies
    # 200 running + 7,100 new: within 0.95 of 10k, not within 0.7 of it.
    assert kv.room(["hbm", "host"], "new", 7_000, 100) == ["host"]
    kv.fill = 0.8  # set: the same ceiling everywhere
    assert kv.ceiling("hbm") == kv.ceiling("host") == 0.8


def test_a_cold_start_forgets_the_back_off_and_a_new_ceiling_applies_live():
    from rayattn.routing.kv_budget import FILL_BACKOFF

    core = RoutingCore(RouterConfig(kv_admission=True,
                                    kv_admission_fill=0.9).routing_settings(), 16)
    core.joined("e0", 16, 5000)
    core.kv._learn("e0", kept=False)
    assert core.kv.fill_of("e0") == 0.9 * FILL_BACKOFF
    # A live change of the ceiling (user_config) keeps the back-off as a share of it.
    core.reconfigure(core.settings.replace(kv_admission_fill=0.5))
    assert core.kv.fill_of("e0") == 0.5 * FILL_BACKOFF
    core.reconfigure(core.settings.replace(kv_admission_fill=None))  # unset: by tier
    assert core.kv.fill_of("e0") == 0.7 * FILL_BACKOFF
    # After a reset the engines are empty: what was lost before says nothing now.
    core.reset()
    assert core.kv.fill_of("e0") == 0.7


def test_auto_climbs_past_the_ceiling_while_histories_are_kept():
    """router.kv_admission auto: an engine's fill starts at the tier's ceiling and, while
    live conversations come back to find their histories kept, climbs to the whole cache;
    one loss brings it back under the ceiling at once. `true` keeps the ceiling a cap."""
    from rayattn.routing.kv_budget import FILL_BACKOFF, HBM_FILL

    def live_engine(kv: KVBudget) -> None:
        kv.joined("e0", 10_000)
        for s in ("a", "b"):
            h = kv.dispatched("e0", s, 3_000, 100)
            kv.finished("e0", s, 3_100)
            kv.ended("e0", s, h)
        kv.dispatched("e0", None, 100, 100)  # something runs: the budget applies

    def back_home(kv: KVBudget, kept: bool) -> None:
        h = kv.dispatched("e0", "a", 3_500, 100, (3_100, 3_100 if kept else 0))
        kv.finished("e0", "a", 3_100)
        kv.ended("e0", "a", h)

    on, auto = KVBudget(idle_s=5.0), KVBudget(idle_s=5.0, climbs=True)
    for kv in (on, auto):
        live_engine(kv)
        # 6,200 live + 200 running + 2,100 new: over 0.7 of the cache, within all of it.
        assert kv.fill_of("e0") == HBM_FILL and kv.room(["e0"], "new", 2_000, 100) == []
        for _ in range(300):
            back_home(kv, kept=True)
    assert on.fill_of("e0") == HBM_FILL and on.room(["e0"], "new", 2_000, 100) == []
    assert auto.fill_of("e0") == 1.0 and auto.room(["e0"], "new", 2_000, 100) == ["e0"]
    # ...but not where the live histories would not fit at all.
    assert auto.room(["e0"], "new", 4_000, 100) == []
    back_home(auto, kept=False)
    assert auto.fill_of("e0") == HBM_FILL * FILL_BACKOFF
    # An explicit fill is a cap in every mode; so is the ceiling after a switch to `true`.
    for _ in range(300):
        back_home(auto, kept=True)
    auto.fill = 0.8
    assert auto.fill_of("e0") == 0.8
    auto.fill, auto.climbs = None, False
    assert auto.fill_of("e0") == HBM_FILL


def test_the_default_is_auto_admission_with_a_learned_window():
    core = RoutingCore(RouterConfig().routing_settings(), 16)
    assert core.settings.kv_admission == "auto" and core.kv.climbs
    assert core.settings.conversation_idle_s is None and core.kv.idle_s is None
    core.reconfigure(core.settings.replace(kv_admission=True))
    assert not core.kv.climbs
    assert RouterConfig(kv_admission="false").kv_admission is False


def test_the_live_window_is_learned_from_the_pauses_between_turns():
    """Unset conversation_idle_s: a conversation stays live for twice the 90th percentile
    pause seen between turns, within 1–60 s, including pauses longer than the window (a
    conversation that comes back after it expired still teaches)."""
    from rayattn.routing.kv_budget import IDLE_DEFAULT_S, IDLE_MAX_S, IDLE_MIN_S

    now = [0.0]
    kv = KVBudget(clock=lambda: now[0])
    kv.joined("e0", 100_000)

    def turns(sessions: int, pause: float) -> None:
        for i in range(sessions):
            s = f"p{pause}-{i}"
            for _ in range(3):
                kv.arrived(s)
                h = kv.dispatched("e0", s, 1_000, 10)
                kv.finished("e0", s, 1_010)
                kv.ended("e0", s, h)
                now[0] += pause

    assert kv.window_s == IDLE_DEFAULT_S
    turns(12, 0.3)  # 24 pauses of 0.3 s
    assert kv.window_s == IDLE_MIN_S
    turns(40, 8.0)  # longer than the window: each conversation expired between turns
    assert kv.window_s == 16.0
    assert kv.is_live("p8.0-39") and not kv.is_live("p0.3-0")
    turns(40, IDLE_MAX_S + 30)  # resumed conversations, not pauses: not learned
    assert kv.window_s == 16.0
    assert KVBudget(idle_s=3.0).window_s == 3.0  # set: not learned


def test_each_router_replica_budgets_its_share_of_every_engine_cache():
    """The front door spreads sessions over the router replicas and each sees only its own
    conversations: each budgets the cache divided by the routers the engines report
    requests from (in the last minute)."""
    from rayattn.routing.load import ROUTER_MEMORY_S

    now = [0.0]
    core = RoutingCore(RouterConfig(kv_admission=True, kv_admission_fill=1.0,
                                    index="predicted").routing_settings(), 16, origin="r0",
                       clock=lambda: now[0])
    core.joined("e0", 16, 500)  # 8,000 tokens
    blocker = core.request(list(range(90_000, 92_000)))
    core.dispatched(core.choose(blocker, ["e0"]), blocker)  # 2,000 tokens run
    route = core.request(list(range(3_000)), session="s")
    route.max_tokens = 100
    assert core.kv_room(route, ["e0"]) == ["e0"]
    core.reported("e0", {"r0": 1, "r1": 2, "r2": 0})  # r2 has nothing there
    assert core.load.routers() == 2 and core.kv.budget("e0") == 4_000
    assert core.kv_room(route, ["e0"]) == []  # 2,000 + 3,100 > 8,000 / 2
    now[0] = ROUTER_MEMORY_S + 1
    assert core.load.routers() == 1 and core.kv_room(route, ["e0"]) == ["e0"]


def test_a_request_too_big_for_the_budget_by_itself_does_not_wait():
    """Waiting makes room only for what fits the router's budget of an engine: a request
    bigger than that by itself goes at once (its engine queues it) instead of waiting for
    its timeout behind requests that keep fitting."""
    kv = KVBudget(idle_s=5.0, fill=0.5)
    kv.joined("e0", 10_000)
    kv.joined("e1", 20_000)
    kv.dispatched("e0", None, 100, 100)  # something runs on both: the budget applies
    kv.dispatched("e1", None, 100, 100)
    h = kv.dispatched("e1", "live", 9_000, 100)
    kv.ended("e1", "live", h)
    # 7,000 fits e1's budget of 10,000 by itself but not next to its live history: it waits.
    assert kv.budget("e1") == 10_000 and kv.room(["e0", "e1"], "big", 7_000, 0) == []
    # 12,000 fits neither budget even alone: it goes.
    assert kv.room(["e0", "e1"], "huge", 12_000, 0) == ["e0", "e1"]
    kv.routers = lambda: 2  # two routers: half the budget each
    assert kv.room(["e0", "e1"], "big", 7_000, 0) == ["e0", "e1"]


def test_a_cold_start_keeps_the_learned_pauses_and_stale_pauses_are_not_learned():
    now = [0.0]
    core = RoutingCore(RouterConfig(index="predicted").routing_settings(), 16,
                       clock=lambda: now[0])
    core.joined("e0", 16, 5000)
    kv = core.kv
    for i in range(20):  # 20 pauses of 3 s
        for _ in range(2):
            kv.arrived(f"s{i}")
            h = kv.dispatched("e0", f"s{i}", 100, 10)
            kv.ended("e0", f"s{i}", h)
            now[0] += 3.0
    assert kv.window_s == 6.0
    core.reset()
    assert core.kv is not kv and core.kv.window_s == 6.0
    # A conversation that went quiet, then came back without arrived() (admission was
    # off meanwhile): its old quiet spell is no pause to learn later.
    kv = core.kv
    h = kv.dispatched("e0", "q", 100, 10)
    kv.ended("e0", "q", h)
    now[0] += 30.0
    assert not kv.is_live("q")  # expired: remembered as gone
    kv.dispatched("e0", "q", 200, 10)  # back, not through arrived(); a turn running
    gaps = list(kv._gaps)
    now[0] += 1.0
    assert kv.arrived("q") and list(kv._gaps) == gaps


def test_a_prefix_cached_before_a_conversation_came_is_not_reserved_for_it():
    """Agent sessions share a long tool prompt, cached once: it is not part of what each
    session adds or of the history admission reserves for it, so sessions that fit the
    cache are not held back as if each carried its own copy."""
    kv = KVBudget(idle_s=5.0, fill=1.0)
    kv.joined("e0", 8_000)
    kv.dispatched("e0", None, 100, 100)  # something runs: the budget applies
    tools = list(range(188))  # 3,008 tokens
    for i in range(4):  # 4 sessions: the tool prompt and 492 tokens of their own each
        h = kv.dispatched("e0", f"s{i}", 3_500, 100, cached_tokens=3_008 if i else 0,
                          keys=tools + [1_000 + i] * 30)
        kv.finished("e0", f"s{i}", 3_600)
        kv.ended("e0", f"s{i}", h)
    # The first one brought the prompt; from the second on it is shared, counted once.
    assert kv.reserved["e0"] == 4 * 592 and kv.prefixes.tokens("e0") == 3_008
    assert kv.adds("e0", "s9", 3_500, 100, cached_tokens=3_008) == 592
    # A fifth session fits next to them; counted as a copy of the prompt each, it would not.
    assert kv.room(["e0"], "s9", 3_500, 100, cached={"e0": 3_008},
                   keys=tools + [9] * 30) == ["e0"]
    assert kv.room(["e0"], "s9", 3_500, 100) == []
    # At home a session keeps what it shared; its own growth is its own.
    h = kv.dispatched("e0", "s1", 4_000, 100, cached_tokens=3_600, keys=tools + [1_001] * 62)
    kv.finished("e0", "s1", 4_100)
    kv.ended("e0", "s1", h)
    assert kv.reserved["e0"] == 3 * 592 + 1_092
    kv.left("e0")
    assert kv.reserved["e0"] == 0 and not kv.is_live("s1")
    assert kv.prefixes.tokens("e0") == 0


def test_the_core_counts_what_the_index_holds_of_a_new_session_as_shared():
    core = RoutingCore(RouterConfig(index="predicted", kv_admission_fill=1.0)
                       .routing_settings(), 16)
    core.joined("e0", 16, 500)  # 8,000 tokens
    tools = list(range(3_008))  # 188 full blocks every session starts with
    for i in range(2):
        route = core.request(tools + [50_000 + i] * 400, session=f"s{i}")
        route.max_tokens = 10
        assert core.kv_room(route, ["e0"]) == ["e0"]
        d = core.choose(route, ["e0"])
        core.dispatched(d, route)
    # s1 found the tool prompt cached: only its own 400 tokens are reserved for it, and s0,
    # which brought it, now shares it: the prompt is counted once, apart.
    assert core.kv.reserved["e0"] == 400 + 400 and core.kv.prefixes.tokens("e0") == 3_008
    route = core.request(tools + [60_000] * 3_000, session="s2")
    route.max_tokens = 10
    assert core.kv_room(route, ["e0"]) == ["e0"]  # 800 + 3,008 + 20 + 3,010 ≤ 8,000


def test_a_prefix_its_bringer_shares_is_counted_once_and_each_router_counts_its_share():
    """Agents' sessions start at once on four routers: on each, the first session of an
    agent brings its tool prompt. Counted as that session's own history, two prompts
    filled a router's quarter of the cache, and the agents' next sessions waited for
    those to end (3.5 s on two H200s: docs/log/cache-pressure-default.md)."""
    now = [0.0]
    kv = KVBudget(idle_s=5.0, fill=1.0, clock=lambda: now[0], routers=lambda: 4,
                  block_size=lambda: 16)
    kv.joined("e0", 34_400)  # a quarter of it: 8,600 tokens
    head = [7, 8]  # a chat template's first two blocks, every prompt's
    tools = {a: head + [a * 1_000 + k for k in range(248)] for a in (1, 2)}  # 4,000 tokens
    kv.dispatched("e0", "a1-0", 4_200, 32, cached_tokens=0, keys=tools[1] + [1])
    # The second agent's first session found only the template's head cached: the head
    # is shared from now on, a1-0 brought it.
    kv.dispatched("e0", "a2-0", 4_200, 32, cached_tokens=32, keys=tools[2] + [2])
    assert kv.reserved["e0"] == 4_168 + 4_168 and kv.prefixes.tokens("e0") == 32
    # Counted as theirs, the prompts leave no room: 64 running + 8,336 + 32 / 4 + 232 > 8,600.
    assert kv.room(["e0"], "a1-1", 4_200, 32, cached={"e0": 4_000}) == []
    # Shared as the next session comes, they do: 64 + 4,368 + 4,000 / 4 + 232 ≤ 8,600.
    assert kv.room(["e0"], "a1-1", 4_200, 32, cached={"e0": 4_000},
                   keys=tools[1] + [3]) == ["e0"]
    kv.dispatched("e0", "a1-1", 4_200, 32, cached_tokens=4_000, keys=tools[1] + [3])
    # Agent 1's prompt is shared from now on, the head inside it counted once.
    assert kv.reserved["e0"] == 200 + 4_168 + 200 and kv.prefixes.tokens("e0") == 4_000
    # a2-0 brought its own prompt past the head: it is its own until a sibling shares it.
    kv.dispatched("e0", "a2-1", 4_200, 32, cached_tokens=4_000, keys=tools[2] + [4])
    assert kv.reserved["e0"] == 200 + 200 + 200 + 200
    assert kv.prefixes.tokens("e0") == 4_000 + 4_000 - 32  # two prompts, one head
    # A prompt that begins like agent 1's but parts from it is not taken for it.
    kv.dispatched("e0", "c-0", 4_200, 32, cached_tokens=160, keys=tools[1][:10] + [5] * 250)
    assert kv._live["c-0"].shared == 160 and kv.prefixes.tokens("e0") == 7_968
    # A session moving away stops using the prefix here; the last one to go takes it along.
    kv.dispatched("e1", "a1-1", 4_400, 32)
    for s in ("a1-0", "a1-1", "a2-0", "a2-1", "c-0"):
        kv.ended(kv._live[s].replica, s, 32)
    now[0] = 10.0
    assert kv.room(["e0"], "z", 100, 10) == ["e0"]  # expires the quiet sessions
    assert kv.prefixes.tokens("e0") == 0 and kv.reserved["e0"] == 0 and not kv._origins


def test_an_engine_that_leaves_takes_its_shared_prefixes_along():
    kv = KVBudget(idle_s=5.0, fill=1.0, block_size=lambda: 16)
    kv.joined("e0", 10_000)
    keys = list(range(100))
    kv.dispatched("e0", "a", 1_700, 10, keys=keys + [1] * 6)
    kv.dispatched("e0", "b", 1_700, 10, cached_tokens=1_600, keys=keys + [2] * 6)
    assert kv.prefixes.tokens("e0") == 1_600
    kv.left("e0")
    assert kv.prefixes.tokens("e0") == 0 and not kv._origins and not kv.is_live("a")


def test_a_held_request_looks_again_at_what_its_siblings_cached_meanwhile():
    core = RoutingCore(RouterConfig(index="predicted", kv_admission_fill=1.0)
                       .routing_settings(), 16)
    core.joined("e0", 16, 500)  # 8,000 tokens
    tools = list(range(3_008))
    first = core.request(tools + [1] * 16, session="s0")
    later = core.request(tools + [2] * 16, session="s1")
    for route in (first, later):
        route.max_tokens = 10
    busy = core.request([9] * 4_900, session="other")
    busy.max_tokens = 100
    d = core.choose(busy, ["e0"])
    core.dispatched(d, busy)
    assert core.kv_room(later, ["e0"]) == []  # 100 + 4,900 + 3,034 > 8,000
    core.dispatched(core.choose(first, ["e0"]), first)  # its sibling ran: the prompt cached
    core.ended(d)
    # Looking again, s1 needs only its own 16 tokens and shares the prompt s0 brought:
    # 10 running + 4,900 + 16 + 3,008 + 26 ≤ 8,000. With what it matched at its first look
    # (nothing cached) it would count the prompt twice and wait on.
    assert core.kv_room(later, ["e0"]) == ["e0"]


def test_a_conversations_own_history_is_its_own_whether_or_not_it_was_cached():
    """What a conversation finds cached that no live conversation shares (its own history
    back after its window, what a conversation gone since left) is its own: reserved for
    it, not counted as a prefix others share."""
    now = [0.0]
    kv = KVBudget(clock=lambda: now[0])  # learned window: 5 s at first
    kv.joined("e0", 100_000)
    kv.arrived("a")
    h = kv.dispatched("e0", "a", 4_000, 100, cached_tokens=1_024, keys=list(range(250)))
    kv.finished("e0", "a", 4_100)
    kv.ended("e0", "a", h)
    assert kv.reserved["e0"] == 4_100 and kv.prefixes.tokens("e0") == 0
    now[0] = 30.0
    assert not kv.is_live("a") and kv.reserved["e0"] == 0
    kv.arrived("a")
    kv.dispatched("e0", "a", 4_500, 100, cached_tokens=4_096, keys=list(range(281)))
    assert kv.reserved["e0"] == 4_500 and kv.prefixes.tokens("e0") == 0


def test_a_history_cut_short_of_what_it_shared_shares_nothing_and_stays_positive():
    kv = KVBudget(idle_s=5.0, fill=1.0)
    kv.joined("e0", 100_000)
    tools = list(range(100))  # 1,600 tokens
    kv.dispatched("e0", "a", 1_700, 10, keys=tools + [1] * 6)
    kv.dispatched("e0", "b", 1_700, 10, cached_tokens=1_600, keys=tools + [2] * 6)
    assert kv._live["a"].shared == 1_600
    # a's client trims its history below the tool prompt: what it finished with is its own.
    kv.finished("e0", "a", 1_000)
    assert kv._live["a"].own == 1_000 and kv.reserved["e0"] == 1_000 + 100
    # ...and a next turn at home shorter than what it shared takes the newcomer's path.
    kv.ended("e0", "a", 10)
    kv.dispatched("e0", "a", 900, 10, cached_tokens=896, keys=tools[:56] + [3])
    assert kv._live["a"].own >= 0 and kv.reserved["e0"] >= 0
    assert kv.prefixes.tokens("e0") == 1_600  # b still uses the prompt


def test_with_a_host_tier_a_prompt_bigger_than_the_budget_goes_at_once():
    """On a host-tier engine a request needs its whole prompt in HBM: one bigger than the
    budget by itself cannot be made room for, whatever of it is cached."""
    kv = KVBudget(idle_s=5.0, fill=0.5)
    kv.joined("host", 10_000, host_tier=True)
    h = kv.dispatched("host", "a", 4_000, 100)
    kv.dispatched("host", "b", 4_000, 100)  # b's turn runs
    kv.finished("host", "a", 4_100)
    kv.ended("host", "a", h)
    assert kv.room(["host"], "a", 4_500, 100, cached={"host": 4_096}) == []  # waits for b
    assert kv.room(["host"], "a", 5_500, 100, cached={"host": 4_096}) == ["host"]
