"""The prefixes conversations share on an engine, counted once (routing/shared_prefixes.py)."""

from __future__ import annotations

from rayattn.routing.shared_prefixes import SharedPrefixes

SYSTEM = [1, 2, 3, 4]  # four blocks every prompt begins with (chained keys: one path each)
TOOLS_A = SYSTEM + [10, 11, 12, 13, 14, 15]
TOOLS_B = SYSTEM + [20, 21]


def test_nested_and_branching_prefixes_count_their_union() -> None:
    p = SharedPrefixes(lambda: 16)
    a = p.use("e0", TOOLS_A, 10)
    assert p.tokens("e0") == 160
    # The system prompt alone lies inside tool prompt A: nothing more in the cache.
    s = p.use("e0", TOOLS_A, 4)
    assert p.tokens("e0") == 160 and p.inside("e0", TOOLS_B, 6) == 4
    # Tool prompt B branches off the same system prompt: only its own two blocks are new.
    b = p.use("e0", TOOLS_B, 6)
    assert p.tokens("e0") == 192 and p.inside("e0", TOOLS_B, 6) == 6
    # With A gone, B and the system prompt remain: 6 blocks.
    p.release("e0", a)
    assert p.tokens("e0") == 96 and p.inside("e0", TOOLS_A, 10) == 4
    p.release("e0", s)
    p.release("e0", b)
    assert p.tokens("e0") == 0 and p.inside("e0", TOOLS_B, 6) == 0


def test_a_prefix_counts_while_any_conversation_uses_it_and_per_engine() -> None:
    p = SharedPrefixes(lambda: 16)
    k = p.use("e0", TOOLS_B, 6)
    assert p.holds("e0", k) and not p.holds("e1", k)
    p.use("e0", TOOLS_B, 6)
    p.use("e1", TOOLS_B, 6)
    p.release("e0", k)
    assert p.tokens("e0") == 96 and p.tokens("e1") == 96
    p.release("e0", k)
    p.release("e0", k)  # once too often: no harm
    assert p.tokens("e0") == 0 and p.tokens("e1") == 96 and not p.holds("e0", k)
    p.forget("e1")
    assert p.tokens("e1") == 0
