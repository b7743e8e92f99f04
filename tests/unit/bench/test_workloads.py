"""Benchmark workloads are seeded and shaped as documented."""

from __future__ import annotations

from rayattn.bench.workloads import WORKLOADS, long_doc_qa, mix, multi_turn, shared_prefix


def test_seeded_and_reproducible():
    for make in WORKLOADS.values():
        a, b = make(seed=3), make(seed=3)
        assert [c.system + "".join(c.turns) for c in a.conversations] == \
            [c.system + "".join(c.turns) for c in b.conversations]
    assert shared_prefix(seed=1).conversations[0].turns != \
        shared_prefix(seed=2).conversations[0].turns


def test_shapes():
    sp = shared_prefix(groups=3, prompts_per_group=4)
    assert sp.num_requests == 12 and len({c.system for c in sp.conversations}) == 3
    mt = multi_turn(conversations=5, turns=3, shared_systems=2)
    assert mt.num_requests == 15 and len({c.system for c in mt.conversations}) == 2
    ld = long_doc_qa(documents=2, questions_per_doc=5)
    assert ld.num_requests == 10 and len({c.system for c in ld.conversations}) == 2
    assert mix().num_requests == 18 + 18 + 12
