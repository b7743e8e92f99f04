"""DP ranks as routing targets (routing/targets.py): the routing core routes to each rank of
an engine that runs data parallelism inside itself as to an engine of its own. A fake
two-rank engine here; tests/integration/test_dp_ranks.py runs a real one."""

from __future__ import annotations

import pytest

from rayattn.config.schema import RouterConfig
from rayattn.routing.core import Finished, RoutingCore
from rayattn.routing.targets import replica_of, split, targets

BS = 16


@pytest.mark.parametrize("replica", ["engine#abc", "rayattn#engine#x1y2", "a@b"])
def test_names_round_trip(replica):
    assert targets(replica, 1) == [replica] and split(replica) == (replica, None)
    names = targets(replica, 3)
    assert len(set(names)) == 3
    assert [split(t) for t in names] == [(replica, r) for r in range(3)]
    assert {replica_of(t) for t in names} == {replica}


def _turn(c: RoutingCore, ids: list[int], session: str, candidates: list[str],
          out: list[int]) -> tuple[str, int]:
    route = c.request(ids, session=session)
    d = c.choose(route, candidates)
    c.dispatched(d, route)
    c.first_token(d)
    c.finished(d, route, Finished(len(ids), d.predicted_cached_tokens, out, {}))
    c.ended(d)
    return d.replica, d.predicted_cached_tokens


def test_conversations_stay_on_the_rank_that_holds_them_and_spread_over_ranks():
    """One replica, two DP ranks on two GPUs: each rank is a cache of its own. Conversations
    start where there is room and keep their rank; the other rank's cache is no hit."""
    c = RoutingCore(RouterConfig(index="predicted").routing_settings(), BS)
    ranks = targets("engine-a", 2)
    for i, name in enumerate(ranks):
        assert c.joined(name, BS, 1000, device=f"GPU-{i}", max_batch=8)
    docs = {s: [s * 10_000 + i for i in range(20 * BS)] for s in (1, 2)}
    # Two conversations start at once: the second sees the first in flight on its rank.
    first = {}
    for s, ids in docs.items():
        route = c.request(ids, session=str(s))
        d = c.choose(route, ranks)
        c.dispatched(d, route)
        first[s] = (d, route)
    assert {d.replica for d, _ in first.values()} == set(ranks)
    for d, route in first.values():
        c.first_token(d)
        c.finished(d, route, Finished(len(route.token_ids), 0, [7] * (BS + 1), {}))
        c.ended(d)
    for _ in range(3):
        for s, ids in docs.items():
            ids += [7] * (BS + 1) + [s] * (2 * BS)
            where, cached = _turn(c, ids, str(s), ranks, [7] * (BS + 1))
            assert where == first[s][0].replica
            assert cached >= 20 * BS
    assert sum(c.session_moves.values()) == 0


def test_load_is_per_rank():
    c = RoutingCore(RouterConfig(index="predicted").routing_settings(), BS)
    ranks = targets("engine-a", 2)
    for i, name in enumerate(ranks):
        assert c.joined(name, BS, 1000, device=f"GPU-{i}")
    c.reported(ranks[0], {"other-router": 5})
    c.reported(ranks[1], {"other-router": 1})
    assert (c.load.inflight[ranks[0]], c.load.inflight[ranks[1]]) == (5, 1)
    d = c.choose(c.request(list(range(3 * BS))), ranks)
    assert d.replica == ranks[1]
