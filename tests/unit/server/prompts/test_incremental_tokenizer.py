"""The router's incremental tokenizing gives exactly the plain tokenizer's ids (the engine
serves them: render once), and reuses the earlier turns' ids where it can."""

from __future__ import annotations

import copy
import random

import pytest

from rayattn.server.prompts import incremental_tokenizer


def _smollm2():
    from transformers import AutoTokenizer

    from rayattn.models.embedded import resolve_embedded

    return AutoTokenizer.from_pretrained(resolve_embedded("rayattn://smollm2-135m"))


def _tiny(tmp_path, bos: bool = False):
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    from rayattn.models.tiny import _tokenizer

    _tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    if bos:  # Llama-style: add_special_tokens=True puts <s> first
        tok._tokenizer.post_processor = TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.convert_tokens_to_ids("<s>"))])
        assert tok("x")["input_ids"][0] == tok.convert_tokens_to_ids("<s>")
    return tok


AWKWARD = ["plain words here", "  two leading spaces", "trailing newline\n", "", "\n\n",
           "ünïcode 漢字 🙂 done", "a user writing <|im_end|> inside a message",
           "<|im_start|>system\nfake turn", "tabs\tand   runs   of spaces  ", "x" * 300]


def _conversation(rng: random.Random, turns: int) -> list[list[dict]]:
    """The message lists of each turn's request: earlier turns, their answers, a new one."""
    msgs = [{"role": "system", "content": rng.choice(AWKWARD) + " system " * rng.randint(0, 50)}]
    out = []
    for _ in range(turns):
        msgs.append({"role": "user", "content": " ".join(rng.choices(AWKWARD, k=3))})
        out.append(list(msgs))
        msgs.append({"role": "assistant", "content": rng.choice(AWKWARD)})
    return out


@pytest.mark.parametrize("which", ["smollm2", "tiny", "tiny-bos"])
def test_every_turn_gets_the_plain_tokenizers_ids(which, tmp_path):
    tok = _smollm2() if which == "smollm2" else _tiny(tmp_path, bos=which == "tiny-bos")
    plain = copy.deepcopy(tok)
    counts = incremental_tokenizer.install(tok)
    assert counts is not None and type(tok) is not type(plain)
    rng = random.Random(7)
    for _ in range(12):
        for special in (False, True):
            for msgs in _conversation(rng, 4):
                text = plain.apply_chat_template(msgs, tokenize=False,
                                                 add_generation_prompt=True)
                got = tok(text, add_special_tokens=special)["input_ids"]
                assert list(got) == plain(text, add_special_tokens=special)["input_ids"]
    # Later turns reused their earlier turns' ids: most tokens were not tokenized again.
    assert counts.reused_tokens > counts.tokenized_tokens > 0


def test_a_branched_conversation_and_truncation_match_the_plain_tokenizer():
    tok = _smollm2()
    plain = copy.deepcopy(tok)
    incremental_tokenizer.install(tok)
    base = [{"role": "system", "content": "You answer. " * 40},
            {"role": "user", "content": "first question"}]
    one = base + [{"role": "assistant", "content": "an answer"},
                  {"role": "user", "content": "second"}]
    edited = base[:1] + [{"role": "user", "content": "first question, edited"},
                         {"role": "assistant", "content": "an answer"},
                         {"role": "user", "content": "second"}]
    for msgs in (base, one, edited, one):
        text = plain.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert tok(text, add_special_tokens=False)["input_ids"] == \
            plain(text, add_special_tokens=False)["input_ids"]
        # vLLM bounds the work with truncation at its length limit + 1: same ids, and a
        # prompt over the limit is cut exactly as the plain tokenizer cuts it.
        for limit in (8, 100_000):
            kw = {"add_special_tokens": False, "truncation": True, "max_length": limit}
            assert list(tok(text, **kw)["input_ids"]) == plain(text, **kw)["input_ids"]
    # Calls it does not handle (offsets, batches) are the tokenizer's own.
    enc = tok(["a<|im_end|>b", "c"], add_special_tokens=False)
    assert enc["input_ids"] == plain(["a<|im_end|>b", "c"], add_special_tokens=False)[
        "input_ids"]


def test_not_installed_where_pieces_do_not_add_up(tmp_path):
    """A tokenizer that adds a space to the start of each text (SentencePiece-style
    `prepend_scheme: first`) tokenizes a tail differently alone than after a special token:
    it is left as it is."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    raw.train_from_iterator(["hello world spaces leading trailing"] * 50, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
        show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>" \
        "{% endfor %}"
    assert sorted(incremental_tokenizer.boundary_tokens(tok)) == ["<|im_end|>", "<|im_start|>"]
    before = type(tok)
    assert incremental_tokenizer.install(tok) is None
    assert type(tok) is before


def test_the_head_cache_is_bounded():
    from array import array

    heads = incremental_tokenizer.HeadCache(max_entries=3, max_bytes=8_100)
    for i in range(5):
        heads.put((False, bytes([i])), array("i", [i]))
    assert len(heads) == 3 and heads.get((False, bytes([0]))) is None
    assert heads.get((False, bytes([4]))).tolist() == [4]
    heads.put((False, b"big"), array("i", range(2000)))  # 8 kB: the oldest make room
    assert heads.get((False, b"big")) is not None and len(heads) == 1


def test_not_installed_where_special_tokens_are_not_split_out():
    """`split_special_tokens=True` tokenizes `<|im_end|>` as plain text: a prompt cut after
    it does not add up, and the tokenizer is left as it is."""
    from transformers import AutoTokenizer

    from rayattn.models.embedded import resolve_embedded

    tok = AutoTokenizer.from_pretrained(resolve_embedded("rayattn://smollm2-135m"),
                                        split_special_tokens=True)
    before = type(tok)
    assert incremental_tokenizer.install(tok) is None and type(tok) is before


def test_many_cut_points_and_other_truncation_arguments():
    """A prompt full of typed special tokens (thousands of cut points), and HF's own
    truncation arguments (a limit alone, truncation alone), give the plain ids."""
    tok = _smollm2()
    plain = copy.deepcopy(tok)
    incremental_tokenizer.install(tok)
    spam = "".join(f"a{i}<|im_end|>" for i in range(3000))
    for text in (spam, spam + "tail", "<|im_start|>" + spam):
        for _ in range(2):  # the second time from the cached head
            assert tok(text, add_special_tokens=False)["input_ids"] == \
                plain(text, add_special_tokens=False)["input_ids"]
    for kw in ({"max_length": 7}, {"truncation": True}, {"truncation": True, "max_length": 7},
               {"truncation": "longest_first", "max_length": 7}):
        assert list(tok(spam, **kw)["input_ids"]) == list(plain(spam, **kw)["input_ids"]), kw


def test_through_vllms_thread_pool_from_many_threads():
    """vLLM's renderer wraps the tokenizer in its pool of copies (renderer_num_workers > 1)
    and tokenizes from several threads at once: the layer sits on top and stays exact."""
    from concurrent.futures import ThreadPoolExecutor

    from vllm.tokenizers.hf import maybe_make_thread_pool

    tok = _smollm2()
    plain = copy.deepcopy(tok)
    maybe_make_thread_pool(tok, 4)
    counts = incremental_tokenizer.install(tok)
    assert counts is not None
    rng = random.Random(3)
    texts = [plain.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
             for _ in range(16) for msgs in _conversation(rng, 4)]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda t: list(tok(t, add_special_tokens=False)["input_ids"]),
                            texts * 2))
    assert got == [plain(t, add_special_tokens=False)["input_ids"] for t in texts * 2]
    assert counts.reused_tokens > 0
