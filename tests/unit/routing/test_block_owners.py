"""The part both cache indexes share (routing/block_owners.py), and each index on top of it:
the LRU bound only in the predicted index, none in the events index."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from rayattn.routing.block_owners import BlockOwners
from rayattn.routing.prefix_index import CacheIndex, EventIndex, PrefixIndex

chains = st.lists(st.integers(0, 30), min_size=1, max_size=10)
# (op, replica, keys): 0 add blocks, 1 discard blocks, 2 remove the replica, 3 add it back
ops = st.lists(st.tuples(st.integers(0, 3), st.sampled_from("abc"), chains), max_size=60)


def _consistent(blocks: BlockOwners) -> None:
    for r in blocks.replicas:
        for key in blocks.held(r) or ():
            assert r in (blocks.owners(key) or ())
    for key, owners in blocks.items():
        assert owners, f"{key} kept with no owner"
        assert all(key in (blocks.held(o) or ()) for o in owners)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_both_directions_stay_consistent(script):
    blocks: BlockOwners[dict[int, None]] = BlockOwners(dict)
    held: dict[str, set[int]] = {}  # the model: what each followed replica holds
    for op, r, keys in script:
        if op == 0:
            for k in keys:
                assert blocks.add(r, k) == (r in held and k not in held[r])
                if r in held:
                    held[r].add(k)
        elif op == 1:
            for k in keys:
                assert blocks.discard(r, k) == (r in held and k in held[r])
                if r in held:
                    held[r].discard(k)
        elif op == 2:
            blocks.remove_replica(r)
            held.pop(r, None)
        else:
            blocks.add_replica(r)
            held.setdefault(r, set())
        _consistent(blocks)
    assert sorted(blocks.replicas) == sorted(held)
    for r, keys in held.items():
        assert set(blocks.held(r) or ()) == keys and blocks.size(r) == len(keys)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from("abc"), chains), chains)
def test_match_is_each_replicas_longest_held_prefix(holdings, query):
    blocks: BlockOwners[dict[int, None]] = BlockOwners(dict)
    for r, keys in holdings.items():
        blocks.add_replica(r)
        for k in keys:
            blocks.add(r, k)
    expected = {}
    for r, keys in holdings.items():
        n = 0
        while n < len(query) and query[n] in keys:
            n += 1
        if n:
            expected[r] = n
    assert blocks.match(query) == expected


def test_match_asks_the_callers_owners_when_given():
    blocks: BlockOwners[dict[int, None]] = BlockOwners(dict)
    blocks.add_replica("a")
    blocks.add("a", 1)
    extra = {2: {"a", "b"}}

    def owners_of(key: int) -> set[str] | None:
        own = blocks.owners(key)
        more = extra.get(key)
        return (own | more) if own and more else own or more

    assert blocks.match([1, 2]) == {"a": 1}
    assert blocks.match([1, 2], owners_of) == {"a": 2}
    assert blocks.match([2], owners_of) == {"a": 1, "b": 1}


def test_holding_kind_is_the_indexes_choice():
    ordered: BlockOwners[OrderedDict[int, None]] = BlockOwners(OrderedDict)
    ordered.add_replica("a")
    for k in (3, 1, 2):
        ordered.add("a", k)
    held = ordered.held("a")
    assert isinstance(held, OrderedDict) and list(held) == [3, 1, 2]
    assert ordered.held("nobody") is None
    assert not ordered.add("nobody", 1) and not ordered.discard("nobody", 1)
    ordered.add_replica("a")  # again: keeps what it holds
    assert ordered.size("a") == 3


def test_both_indexes_are_cache_indexes():
    def use(index: CacheIndex) -> dict[str, int]:
        index.add_replica("a", 4)
        index.insert("a", [1, 2])
        return index.match([1, 2, 3])

    assert use(PrefixIndex()) == {"a": 2}
    assert use(EventIndex()) == {"a": 2}  # on the router's word (the overlay)


def test_events_index_has_no_capacity_bound():
    idx = EventIndex()
    idx.add_replica("a", 2)  # the engine's capacity: the engine evicts, not the index
    idx.stored("a", list(range(100)))
    assert idx.size("a") == 100
    assert idx.match(list(range(100))) == {"a": 100}
    assert not isinstance(idx, PrefixIndex)
    assert not hasattr(idx, "capacity")


def test_predicted_index_bound_is_its_lru():
    evicted: list[tuple[str, int]] = []
    idx = PrefixIndex(on_evict=lambda r, k: evicted.append((r, k)))
    idx.add_replica("a", 3)
    idx.insert("a", [1, 2, 3])
    idx.insert("a", [1, 9])  # 1 touched again, 9 new: the least recent (3, a tail) goes
    assert evicted == [("a", 3)]
    assert idx.match([1, 2]) == {"a": 2} and idx.size("a") == 3
    idx.add_replica("a", 1)  # a smaller capacity evicts down to it at once
    assert idx.size("a") == 1 and idx.match([1]) == {"a": 1}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from("ab"), chains), max_size=40))
def test_events_truth_matches_a_plain_model(script):
    """`stored` / `removed` / `reset` / `remove_replica` keep the engines' truth exactly
    (no overlay: nothing is inserted), whatever their order."""
    idx = EventIndex(clock=lambda: 0.0)
    truth: dict[str, set[int]] = {"a": set(), "b": set()}
    for r in truth:
        idx.add_replica(r)
    for op, r, keys in script:
        if op == 0:
            idx.stored(r, keys)
            if r in truth:
                truth[r] |= set(keys)
        elif op == 1:
            idx.removed(r, keys)
            if r in truth:
                truth[r] -= set(keys)
        elif op == 2:
            idx.reset(r, keys)
            if r in truth:
                truth[r] = set(keys)
        else:
            idx.remove_replica(r)
            truth.pop(r, None)
        _consistent(idx._blocks)
    for r, keys in truth.items():
        assert idx.size(r) == len(keys)
    assert sorted(idx.replicas) == sorted(truth)


def test_the_holders_of_a_prefix_come_in_name_order():
    """Not in a set's order (Python's string hashing, seeded per process): a policy taking
    the first of equal holders must pick the same engine in every router replica."""
    owners: BlockOwners[OrderedDict[int, None]] = BlockOwners(OrderedDict)
    names = [f"engine-{i}" for i in (7, 3, 19, 0, 12, 5, 16, 9, 1, 14, 11, 2, 18, 6, 10,
                                      4, 15, 8, 17, 13)]
    for name in names:
        owners.add_replica(name)
        for key in (1, 2) if name.endswith("3") else (1,):
            owners.add(name, key)
    got = owners.match([1, 2])
    assert list(got) == sorted(names)
    assert got["engine-3"] == got["engine-13"] == 2 and got["engine-7"] == 1
