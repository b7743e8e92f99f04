"""MirroredBlocks alone: an engine's blocks as its KV events say, and who cleared it last."""

from __future__ import annotations

from rayattn.engine.mirrored_blocks import MirroredBlocks


def test_gpu_blocks_and_counted_host_blocks():
    b = MirroredBlocks()
    b.stored([1, 2, 3], "gpu")
    b.stored([7, 7, 8], "cpu")
    b.removed([2], "gpu")
    b.removed([7, 8], "cpu")
    assert len(b) == 2 and b.offloaded_blocks == 1
    snap = b.snapshot(5)
    assert (snap.seq, snap.keys, snap.offloaded) == (5, [1, 3], [7])


def test_a_vllm_clear_empties_both_tiers_and_remembers_its_batch():
    b = MirroredBlocks()
    b.stored([1], "gpu")
    b.stored([2], "cpu")
    b.applying = 9
    b.cleared()
    assert len(b) == 0 and b.offloaded_blocks == 0 and b.vllm_cleared == 9


def test_forget_empties_without_claiming_a_vllm_clear():
    b = MirroredBlocks()
    b.stored([1], "gpu")
    b.forget()
    assert len(b) == 0 and b.vllm_cleared == -1
