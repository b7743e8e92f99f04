"""PromptKeys alone: a prompt's block keys, a conversation's turns hashed once."""

from __future__ import annotations

import pytest

from rayattn.routing.hashing import BlockHasher, to_key
from rayattn.routing.prompt_keys import PromptKeys

BS = 4


def test_keys_are_the_block_hashers_and_a_next_turn_hashes_only_its_new_blocks():
    k = PromptKeys(BS)
    first = list(range(10))
    r1 = k.route(first, session="s")
    assert r1.keys == [to_key(h) for h in BlockHasher(BS).full_hashes(first)]
    assert k.hashed_blocks == 2 and r1.continued_tokens == 0
    r2 = k.route(first + list(range(100, 110)), session="s")
    assert r2.continued_tokens == 2 * BS and k.hashed_blocks == 2 + 3


def test_the_continuation_adds_the_output_but_its_last_id_and_is_remembered():
    k = PromptKeys(BS)
    route = k.route(list(range(8)), session="s")
    keys = k.continuation(route, [50, 51, 52, 53, 54])  # 8 + 4 cached ids: three blocks
    assert keys[:2] == route.keys and len(keys) == 3
    nxt = k.route(list(range(8)) + [50, 51, 52, 53, 54, 60, 61], session="s")
    assert nxt.continued_tokens == 3 * BS and nxt.keys == keys


def test_salt_and_adapter_name_the_conversation_and_change_the_keys():
    k = PromptKeys(BS, adapters={"x": "/path/x"})
    plain = k.route(list(range(8)), session="s")
    salted = k.route(list(range(8)), session="s", salt="t")
    adapted = k.route(list(range(8)), session="s", adapter="x")
    assert len({tuple(r.keys) for r in (plain, salted, adapted)}) == 3
    assert salted.session != plain.session != adapted.session
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        k.route(list(range(8)), adapter="nope")


def test_rehash_changes_the_block_size_and_forgets_the_conversations():
    k = PromptKeys(BS)
    k.route(list(range(16)), session="s")
    k.rehash(8)
    r = k.route(list(range(16)), session="s")
    assert k.block_size == 8 and len(r.keys) == 2 and r.continued_tokens == 0


def test_an_empty_session_names_no_conversation():
    k = PromptKeys(BS)
    assert k.route(list(range(8)), session="").session is None
    assert len(k.prefixes) == 0
