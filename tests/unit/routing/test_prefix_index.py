"""Property tests of the prefix index: bounded by capacity, LRU, exact prefix matching."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rayattn.routing.prefix_index import PrefixIndex

chains = st.lists(st.integers(0, 40), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), chains), max_size=60),
       st.integers(1, 20))
def test_never_exceeds_capacity_and_owners_consistent(ops, cap):
    idx = PrefixIndex()
    for r in "abc":
        idx.add_replica(r, cap)
    for r, chain in ops:
        idx.insert(r, chain)
        assert idx.size(r) <= cap
    blocks = idx._blocks
    for r in "abc":
        for key in blocks.held(r) or ():
            assert r in (blocks.owners(key) or ())
    for key, owners in blocks.items():
        assert owners and all(key in (blocks.held(o) or ()) for o in owners)


@settings(max_examples=200, deadline=None)
@given(chains, chains)
def test_match_is_longest_held_prefix(held, query):
    idx = PrefixIndex()
    idx.add_replica("a", 1000)
    idx.insert("a", held)
    expected = 0
    held_set = set(held)
    for k in query:
        if k not in held_set:
            break
        expected += 1
    assert idx.match(query).get("a", 0) == expected


def test_lru_evicts_tails_first_and_least_recent():
    idx = PrefixIndex()
    idx.add_replica("a", 4)
    idx.insert("a", [1, 2, 3])
    idx.insert("a", [10, 11])  # over capacity: the LRU tail of the first chain goes
    assert idx.match([1, 2, 3]) == {"a": 2}
    assert idx.match([10, 11]) == {"a": 2}


def test_remove_replica_forgets_everything():
    idx = PrefixIndex()
    idx.add_replica("a", 10)
    idx.add_replica("b", 10)
    idx.insert("a", [1, 2])
    idx.insert("b", [1])
    idx.remove_replica("a")
    assert idx.match([1, 2]) == {"b": 1}
    assert "a" not in idx.replicas
    idx.insert("a", [5])  # late completion from a removed replica is ignored
    assert idx.match([5]) == {}


def test_precise_mode_block_removal():
    idx = PrefixIndex()
    idx.add_replica("a", 10)
    idx.insert("a", [1, 2, 3])
    idx.remove_blocks("a", [2])
    assert idx.match([1, 2, 3]) == {"a": 1}
