"""HostTier alone: a replica's host-memory blocks, counted, and the run past a GPU hit."""

from __future__ import annotations

from rayattn.routing.host_tier import HostTier


def test_a_block_leaves_with_the_last_chunk_that_announced_it():
    h = HostTier()
    h.add_replica("a")
    h.stored("a", [1, 2])
    h.stored("a", [2])
    h.removed("a", [2])
    assert h.size("a") == 2
    h.removed("a", [1, 2])
    assert h.size("a") == 0
    h.removed("gone", [1])  # not followed: nothing to do


def test_extend_counts_the_host_run_past_each_gpu_hit():
    h = HostTier()
    for r in ("a", "b", "c"):
        h.add_replica(r)
    h.stored("a", [3, 4])
    h.stored("b", [1, 2, 3])
    held = {"a": 2, "c": 1}
    reloaded = h.extend([1, 2, 3, 4, 5], held)
    assert held == {"a": 4, "b": 3, "c": 1}
    assert reloaded == {"a": 2, "b": 3}


def test_remove_replica_forgets_its_blocks():
    h = HostTier()
    h.add_replica("a")
    h.stored("a", [1])
    h.remove_replica("a")
    assert h.size("a") == 0 and h.extend([1], {}) == {}
