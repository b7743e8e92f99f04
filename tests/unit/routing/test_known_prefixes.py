"""KnownPrefixes alone: what a conversation's next turn shares with its last one."""

from __future__ import annotations

from rayattn.routing.known_prefixes import KnownPrefixes

BS = 4


def _hashes(n: int) -> list[bytes]:
    return [bytes([i]) for i in range(n)]


def test_a_longer_turn_shares_every_full_block_of_the_last():
    p = KnownPrefixes(BS)
    p.remember("s", list(range(10)), _hashes(2))
    assert p.known(list(range(20)), "s") == _hashes(2)
    assert p.known(list(range(20)), "other") == []


def test_a_diverged_turn_shares_the_blocks_before_the_first_difference():
    p = KnownPrefixes(BS)
    p.remember("s", list(range(16)), _hashes(4))
    edited = list(range(16))
    edited[9] = 99  # in the third block
    assert p.known(edited, "s") == _hashes(2)


def test_ids_beyond_32_bits_are_not_kept():
    p = KnownPrefixes(BS)
    p.remember("s", [1 << 40] * 8, _hashes(2))
    assert len(p) == 0 and p.known([1 << 40] * 8, "s") == []


def test_the_budget_drops_the_least_recently_remembered():
    p = KnownPrefixes(BS, budget_tokens=40)
    for s in ("a", "b", "c"):
        p.remember(s, list(range(10)), _hashes(2))
    assert p.tokens == 30
    p.remember("d", list(range(10)), _hashes(2))  # 40: still within
    p.remember("a", list(range(10)), _hashes(2))  # re-remembered: now the newest
    p.remember("e", list(range(10)), _hashes(2))  # 50: "b" goes
    assert p.known(list(range(10)), "b") == [] and p.known(list(range(10)), "a")
    assert p.tokens == 40


def test_one_conversation_may_not_take_a_quarter_of_the_budget():
    p = KnownPrefixes(BS, budget_tokens=40)
    p.remember("s", list(range(8)), _hashes(2))
    p.remember("s", list(range(11)), _hashes(2))  # over 40 // 4: the old one goes too
    assert len(p) == 0 and p.tokens == 0


def test_clear_with_a_block_size_matches_that_size_from_then_on():
    p = KnownPrefixes(BS)
    p.remember("s", list(range(8)), _hashes(2))
    p.clear(8)
    assert len(p) == 0 and p.block_size == 8
