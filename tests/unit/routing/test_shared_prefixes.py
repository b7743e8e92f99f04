"""The prefixes conversations share on an engine, counted once (routing/shared_prefixes.py)."""

from __future__ import annotations

from rayattn.routing.shared_prefixes import SharedPrefixes

SYSTEM = [1, 2, 3, 4]  # four blocks every prompt begins with
TOOLS_A = SYSTEM + [10, 11, 12, 13, 14, 15]
TOOLS_B = SYSTEM + [20, 21]


def test_nested_and_branching_prefixes_count_their_union() -> None:
    p = SharedPrefixes()
    assert p.added_by("e0", TOOLS_A, 10, 16) == 160
    a = p.use("e0", TOOLS_A, 10, 16)
    # The system prompt alone lies inside tool prompt A: nothing more in the cache.
    assert p.added_by("e0", SYSTEM, 4, 16) == 0
    s = p.use("e0", TOOLS_A, 4, 16)
    assert p.tokens("e0") == 160
    # Tool prompt B branches off the same system prompt: only its own two blocks are new.
    assert p.added_by("e0", TOOLS_B, 6, 16) == 32
    b = p.use("e0", TOOLS_B, 6, 16)
    assert p.tokens("e0") == 192
    # With A gone, B and the system prompt remain: 6 blocks.
    p.release("e0", a)
    assert p.tokens("e0") == 96
    p.release("e0", s)
    p.release("e0", b)
    assert p.tokens("e0") == 0 and p.added_by("e0", TOOLS_B, 6, 16) == 96


def test_a_prefix_counts_while_any_conversation_uses_it_and_per_engine() -> None:
    p = SharedPrefixes()
    k = p.use("e0", TOOLS_B, 6, 16)
    p.use("e0", TOOLS_B, 6, 16)
    p.use("e1", TOOLS_B, 6, 16)
    p.release("e0", k)
    assert p.tokens("e0") == 96 and p.tokens("e1") == 96
    p.release("e0", k)
    p.release("e0", k)  # once too often: no harm
    assert p.tokens("e0") == 0 and p.tokens("e1") == 96
    p.forget("e1")
    assert p.tokens("e1") == 0
