"""What to prefill on engines that come and go (routing/warm_plan.py), from conversations
routed through a real routing core (vLLM's block hashes, the core's decision log)."""

from __future__ import annotations

from array import array

from rayattn.config.schema import RouterConfig
from rayattn.routing import warm_plan
from rayattn.routing.core import Finished, RoutingCore
from rayattn.routing.prompt_keys import PromptKeys

BS = 16
SYSTEM = list(range(1, 2 * BS + 1))  # a 2-block system prompt every conversation starts with
DOCUMENT = list(range(1000, 1000 + 4 * BS))  # a 4-block document two of them ask about


def history(keys: PromptKeys, ids: list[int], salt: str | None = None
            ) -> tuple[array, list[bytes], str | None]:
    return array("I", ids), keys.hasher.full_hashes(ids, [], salt), salt


def test_the_most_widely_shared_prefix_first_then_the_longer_ones():
    keys = PromptKeys(BS)
    h = [history(keys, SYSTEM + DOCUMENT + [7] * 20),
         history(keys, SYSTEM + DOCUMENT + [8] * 40),
         history(keys, SYSTEM + [9] * 50),
         history(keys, [5] * 100)]  # shares nothing
    # The system prompt (3 conversations) before the document's prefix (2), which adds its
    # own blocks to it.
    shared = warm_plan.shared_prefixes(h, BS)
    plan = warm_plan.within(shared, BS, budget_tokens=10_000)
    assert [(p.token_ids(), p.sessions) for p in plan] == [(SYSTEM, 3), (SYSTEM + DOCUMENT, 2)]
    # Too small a budget for the whole document: its leading blocks; nothing beyond.
    plan = warm_plan.within(shared, BS, budget_tokens=5 * BS + 5)
    assert [(p.token_ids(), p.sessions) for p in plan] == [(SYSTEM, 3),
                                                           (SYSTEM + DOCUMENT[:BS], 2)]
    assert warm_plan.shared_prefixes(h[2:], BS) == []


def test_prefixes_are_shared_only_within_one_cache_namespace():
    keys = PromptKeys(BS)
    h = [history(keys, SYSTEM + [7] * 20, salt="tenant-a"),
         history(keys, SYSTEM + [8] * 20, salt="tenant-b"),
         history(keys, SYSTEM + [9] * 20, salt="tenant-b")]
    plan = warm_plan.within(warm_plan.shared_prefixes(h, BS), BS, budget_tokens=10_000)
    assert [(p.token_ids(), p.sessions, p.salt) for p in plan] == [(SYSTEM, 2, "tenant-b")]


def test_moves_keep_the_most_recent_within_the_budget():
    convs = [("new", 3.0, array("I", [1] * 30), None), ("big", 2.0, array("I", [2] * 100), None),
             ("tiny", 1.5, array("I", [4] * 10), None), ("old", 1.0, array("I", [3] * 30), "s")]
    plan = warm_plan.moves(convs, BS, budget_tokens=70)
    # Too big for what is left, and shorter than a block (it would cache nothing): not moved.
    assert [(p.session, p.tokens, p.salt, p.at) for p in plan] == [("new", 30, None, 3.0),
                                                                    ("old", 30, "s", 1.0)]


def _turn(c: RoutingCore, session: str, ids: list[int], on: str) -> None:
    route = c.request(ids, session=session)
    d = c.choose(route, [on])
    c.dispatched(d, route)
    c.finished(d, route, Finished(len(ids), 0, [42] * 5, {}))
    c.ended(d)


def test_a_leaving_engines_conversations_go_where_their_next_turn_would():
    now = [100.0]
    c = RoutingCore(RouterConfig(index="predicted").routing_settings(), BS,
                    clock=lambda: now[0])
    for name in ("a", "b", "c"):
        assert c.joined(name, BS, 1000)
    _turn(c, "s1", SYSTEM + [7] * 40, on="a")
    _turn(c, "s2", SYSTEM + [8] * 40, on="b")
    now[0] += 1
    _turn(c, "s3", SYSTEM + [9] * 40, on="a")
    # s1 has ended: its last turn ended longer ago than a conversation's pause (the KV
    # budget's live window, its default before any pause was seen); s3 is still live.
    now[0] += c.kv.window_s - 0.5
    _turn(c, "s4", SYSTEM + [6] * 40, on="a")
    plan = c.move_plan(["a"], ["b", "c"])
    assert [p.session for p in plan] == ["s4", "s3"]
    # Its prompt and its answer (but the last token, never computed), as cached on "a".
    assert plan[0].token_ids() == SYSTEM + [6] * 40 + [42] * 4
    c.left("a")
    # "b" holds the system prompt (s2's turn): the policy sends s4's next turn there, which
    # its decision log says once its history is there.
    assert c.move_target(plan[0], ["b", "c"]) == "b"
    assert c.decisions.previous("s4") == "a"
    c.moved(plan[0], "b")
    assert c.decisions.previous("s4") == "b"
    # A turn that came meanwhile found its own way (even to an engine of the same name that
    # came back): nothing to move, nothing recorded.
    now[0] += 1
    _turn(c, "s3", SYSTEM + [9] * 60, on="c")
    assert c.move_target(plan[1], ["b", "c"]) is None
    c.moved(plan[1], "b")
    assert c.decisions.previous("s3") == "c"


def test_every_router_warms_within_its_share_of_a_cache():
    c = RoutingCore(RouterConfig(index="predicted").routing_settings(), BS)
    assert c.joined("a", BS, 1000)
    for i in range(3):
        _turn(c, f"s{i}", SYSTEM + DOCUMENT + [i + 7] * 40, on="a")
    assert c.joined("new", BS, 24)  # a quarter: 6 blocks, the shared 6
    assert [p.tokens for p in c.warm_plans(["new"])["new"]] == [6 * BS]
    c.reported("a", {"other-router": 1})  # a second router sends to these engines
    assert [p.tokens for p in c.warm_plans(["new"])["new"]] == [3 * BS]
    assert c.move_plan(["a"], ["new"]) == []  # 6 blocks (half of 24, halved): 140 tokens each


def test_a_joining_engine_gets_the_shared_prefixes_within_a_quarter_of_its_cache():
    c = RoutingCore(RouterConfig(index="predicted").routing_settings(), BS)
    assert c.joined("a", BS, 1000)
    for i in range(3):
        _turn(c, f"s{i}", SYSTEM + DOCUMENT + [i + 7] * 40, on="a")
    assert c.joined("new", BS, 24)  # 24 blocks: 6 may be warmed, the shared 6 fit
    assert c.joined("small", BS, 12)  # 3 blocks: the system prompt and a block more
    plans = c.warm_plans(["new", "small"])
    assert [p.token_ids() for p in plans["new"]] == [SYSTEM + DOCUMENT]
    assert [p.token_ids() for p in plans["small"]] == [SYSTEM + DOCUMENT[:BS]]


def test_comparison_policies_are_not_warmed_for():
    c = RoutingCore(RouterConfig(index="predicted", policy="sticky").routing_settings(), BS)
    assert not c.warms_engines
    assert RoutingCore(RouterConfig().routing_settings(), BS).warms_engines
