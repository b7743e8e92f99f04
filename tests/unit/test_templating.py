"""The router's cached tokenization is the tokenizer's, token for token."""

from __future__ import annotations

import random

import pytest

from rayattn.server.templating import Templater


@pytest.fixture(scope="module")
def templater():
    from rayattn.models.embedded import resolve_embedded

    return Templater(str(resolve_embedded("rayattn://smollm2-135m")))


def test_piece_cache_is_on_and_exact_for_random_chats(templater):
    assert templater._split is not None
    rng = random.Random(0)
    words = ["alpha", " beta", "\\n", "  ", "ünï", "123", "<|im_end|", "\t", "Paris.", "é"]
    for _ in range(200):
        msgs = [{"role": rng.choice(["system", "user", "assistant"]),
                 "content": "".join(rng.choice(words) for _ in range(rng.randint(0, 30)))}
                for _ in range(rng.randint(1, 5))]
        text = templater.tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                       tokenize=False)
        plain = templater.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert templater.chat(msgs) == plain
        assert templater.chat(msgs) == plain  # second time from the cache


def test_cache_falls_back_when_pieces_are_not_independent(templater, monkeypatch):
    t = Templater.__new__(Templater)
    t.tokenizer = templater.tokenizer
    t._split = templater._split
    t._piece = lambda piece: (1,)  # a tokenizer whose pieces do not add up
    t._encode_plain = templater._encode_plain
    assert not t._segments_exact()
