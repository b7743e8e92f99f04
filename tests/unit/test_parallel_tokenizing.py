"""A long text tokenized in pieces on several cores gets exactly the ids of tokenizing it
whole (the engine serves the router's ids), and the router only does it where that holds."""

from __future__ import annotations

import copy
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from rayattn.bench.workloads import doc_chat
from rayattn.server import incremental_tokenizer, parallel_tokenizing

from .test_incremental_tokenizer import AWKWARD, _smollm2, _tiny


@pytest.fixture
def cores(monkeypatch):
    monkeypatch.setattr(parallel_tokenizing, "_cores", lambda: 6)


def _long_texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    docs = [c.system + "\n" + c.turns[0] for c in doc_chat(
        conversations=6, turns=1, doc_words=1400, user_words=160, max_tokens=8,
        seed=seed).conversations]
    mixed = [" ".join(rng.choices(AWKWARD + ["it's", "don't", "4.5", "x,y", "¿qué?"], k=900))
             for _ in range(6)]
    return docs + mixed


@pytest.mark.parametrize("which", ["smollm2", "tiny"])
def test_pieces_give_the_whole_texts_ids(which, tmp_path, cores):
    tok = _smollm2() if which == "smollm2" else _tiny(tmp_path)
    pieces = parallel_tokenizing.install(tok)
    assert pieces is not None
    for text in _long_texts(1):
        assert parallel_tokenizing.cut_points(text, 4)  # it does cut these
        assert pieces.ids(text) == tok(text, add_special_tokens=False)["input_ids"]
    assert pieces.ids("short text") is None  # not worth cutting: tokenized the usual way


def test_cuts_fall_between_a_letter_and_a_spaced_letter():
    text = "  a, b  c\nd e " + "word " * 2000 + "漢字 ünï 🙂 end"
    cuts = parallel_tokenizing.cut_points(text, 8)
    assert len(cuts) == 7 and cuts == sorted(set(cuts))
    for i in cuts:
        assert text[i] == " " and text[i - 1].isalpha() and text[i + 1].isalpha()


def _custom(normalizer=None, pre=None):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.normalizer = normalizer
    raw.pre_tokenizer = pre or pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(["hello world spaces leading trailing"] * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>"), normalizers, \
        pre_tokenizers


def test_not_installed_where_pieces_could_differ(monkeypatch, cores):
    tok, normalizers, pre_tokenizers = _custom()
    assert parallel_tokenizing.install(tok) is not None  # the plain shape is taken
    for normalizer, pre in [
            (normalizers.NFKC(), None),  # normalizes the whole text first
            (None, pre_tokenizers.ByteLevel(add_prefix_space=True)),  # a space before each
            (None, pre_tokenizers.Metaspace(prepend_scheme="first")),  # SentencePiece-style
            (None, pre_tokenizers.Whitespace())]:
        assert parallel_tokenizing.install(_custom(normalizer, pre)[0]) is None, (normalizer, pre)
    # An added token that takes the space after it: "hello| def" would lose that space.
    from tokenizers import AddedToken

    greedy, _, _ = _custom()
    greedy.add_tokens([AddedToken("hello", rstrip=True)])
    assert parallel_tokenizing.install(greedy) is None
    monkeypatch.setattr(parallel_tokenizing, "_cores", lambda: 1)
    assert parallel_tokenizing.install(tok) is None  # one core: nothing to gain


def test_the_router_tokenizes_new_long_prompts_in_pieces_from_many_threads(cores):
    """As the router runs it: vLLM's pool of tokenizer copies, the incremental layer on top,
    several threads at once, some calls truncating: exact ids, and the long new prompts
    were tokenized in pieces."""
    from vllm.tokenizers.hf import maybe_make_thread_pool

    tok = _smollm2()
    plain = copy.deepcopy(tok)
    maybe_make_thread_pool(tok, 4)
    counts = incremental_tokenizer.install(tok)
    assert counts is not None
    texts = [plain.apply_chat_template([{"role": "system", "content": "You help."},
                                        {"role": "user", "content": t}],
                                       tokenize=False, add_generation_prompt=True)
             for t in _long_texts(2)]
    # A limit above the prompt keeps to the layer; one below it is transformers' own call,
    # which sets truncation on the tokenizer's backend.
    calls = [(t, {"add_special_tokens": False}) for t in texts] + \
        [(t, {"add_special_tokens": False, "truncation": True, "max_length": limit})
         for t in texts for limit in (10**6, 50)]

    def run(call):
        text, kw = call
        return list(tok(text, **kw)["input_ids"])

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(run, calls * 3))
    assert got == [list(plain(t, **kw)["input_ids"]) for t, kw in calls * 3]
    assert counts.pieced_tokens > 0
