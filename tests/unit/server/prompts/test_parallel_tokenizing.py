"""A long text tokenized in pieces on several cores gets exactly the ids of tokenizing it
whole (the engine serves the router's ids), and the router only does it where that holds."""

from __future__ import annotations

import copy
import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from rayattn.bench.workloads import doc_chat
from rayattn.server.prompts import incremental_tokenizer, parallel_tokenizing

from .test_incremental_tokenizer import AWKWARD, _smollm2, _tiny


@pytest.fixture
def cores(monkeypatch):
    monkeypatch.setattr(parallel_tokenizing, "_cores", lambda: 6)
    monkeypatch.setattr(parallel_tokenizing, "CORES", parallel_tokenizing._Cores())


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
    # A later turn's new text (~150 words): cut in two, still exact.
    for text in _long_texts(2):
        tail = text[:parallel_tokenizing.MIN_CUT_CHARS + 300]
        assert parallel_tokenizing.cut_points(tail, 2)
        assert pieces.ids(tail) == tok(tail, add_special_tokens=False)["input_ids"]
        assert pieces.whole(tail) == tok(tail, add_special_tokens=False)["input_ids"]


def test_cuts_fall_between_a_letter_and_a_spaced_letter():
    text = "  a, b  c\nd e " + "word " * 2000 + "漢字 ünï 🙂 end"
    cuts = parallel_tokenizing.cut_points(text, 8)
    assert len(cuts) == 7 and cuts == sorted(set(cuts))
    for i in cuts:
        assert text[i] == " " and text[i - 1].isalpha() and text[i + 1].isalpha()


def _custom(normalizer=None, pre=None, corpus=("hello world spaces leading trailing",)):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.normalizer = normalizer
    raw.pre_tokenizer = pre or pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(list(corpus) * 50, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")


def test_not_installed_where_pieces_could_differ(monkeypatch, cores):
    from tokenizers import AddedToken, Regex, normalizers
    from tokenizers import pre_tokenizers as pt

    assert parallel_tokenizing.install(_custom()) is not None  # the plain shape is taken
    words_across_spaces = pt.Sequence([pt.Split(Regex(r"\S+\s?\S*"), "isolated"),
                                       pt.ByteLevel(add_prefix_space=False, use_regex=False)])
    for normalizer, pre in [
            (normalizers.NFKC(), None),  # normalizes the whole text first
            (None, pt.ByteLevel(add_prefix_space=True)),  # a space where a text has none
            (None, pt.Metaspace(prepend_scheme="first")),  # SentencePiece-style
            (None, pt.Whitespace()),
            (None, pt.ByteLevel(add_prefix_space=False, use_regex=False)),  # no split at all
            (None, pt.Sequence([])),
            # Allowed steps, but a regex whose pre-tokens run across the cuts ("of the")
            (None, words_across_spaces)]:
        tok = _custom(normalizer, pre, corpus=("of the way by the sea " * 20,))
        assert parallel_tokenizing.install(tok) is None, (normalizer, pre)
    # The same with a vocabulary that merges nothing across a space: the shape passes and
    # the self-test's ids agree; only where its pre-tokens start shows other words would not.
    tok = _custom(None, words_across_spaces, corpus=("ofthewaybythesea",))
    assert parallel_tokenizing._shape_ok(json.loads(tok._tokenizer.to_str()), tok)
    assert parallel_tokenizing.install(tok) is None
    # An added token that takes the space after it: "hello| def" would lose that space.
    greedy = _custom()
    greedy.add_tokens([AddedToken("hello", rstrip=True)])
    assert parallel_tokenizing.install(greedy) is None
    # Special tokens tokenized as text: a copy of the backend would not know.
    from transformers import AutoTokenizer

    from rayattn.models.embedded import resolve_embedded

    assert parallel_tokenizing.install(AutoTokenizer.from_pretrained(
        resolve_embedded("rayattn://smollm2-135m"), split_special_tokens=True)) is None


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.mark.parametrize("normalizer", [None, "NFC", "empty"])
def test_llama3_qwen_and_deepseek_shapes_are_taken_and_exact(normalizer, cores):
    """Split by Llama 3's regex, then bytes (Qwen's and DeepSeek's layout), with Qwen's NFC
    and DeepSeek-V3's empty normalizer sequence."""
    from tokenizers import Regex, normalizers
    from tokenizers import pre_tokenizers as pt

    norm = {None: None, "NFC": normalizers.NFC(), "empty": normalizers.Sequence([])}[normalizer]
    tok = _custom(norm, pt.Sequence([pt.Split(Regex(LLAMA3_SPLIT), "isolated"),
                                     pt.ByteLevel(add_prefix_space=False, use_regex=False)]),
                  corpus=[t[:2000] for t in _long_texts(4)])
    pieces = parallel_tokenizing.install(tok)
    assert pieces is not None
    for text in _long_texts(5) + ["e\u0301 combining " * 600]:
        assert pieces.ids(text) == tok(text, add_special_tokens=False)["input_ids"]


def test_the_core_count_follows_the_tokenizers_settings(monkeypatch):
    monkeypatch.setattr(parallel_tokenizing.os, "sched_getaffinity", lambda _: set(range(8)),
                        raising=False)
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    assert parallel_tokenizing._cores() == 8
    monkeypatch.setenv("RAYON_NUM_THREADS", "3")
    assert parallel_tokenizing._cores() == 3
    for off in ("false", "", "f", "N", "0"):  # the library's own reading of "off"
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", off)
        assert parallel_tokenizing._cores() == 1, off
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    assert parallel_tokenizing._cores() == 3


def test_texts_stay_whole_while_the_cores_are_taken(cores):
    """64 new prompts at once gain nothing from cutting each: a text is cut only into the
    cores that other texts' pieces leave free, holds them while it runs, and gives them
    back, also when tokenizing fails."""
    tok = _smollm2()
    pieces = parallel_tokenizing.install(tok)
    text = _long_texts(3)[0]
    count = parallel_tokenizing.CORES
    held: list[int] = []
    real = pieces.backend

    class Watching:
        def encode_batch(self, parts, **kw):
            held.append(count.free)
            return real.encode_batch(parts, **kw)

    pieces.backend = Watching()
    assert pieces.ids(text) == tok(text, add_special_tokens=False)["input_ids"]
    assert held == [0] and count.free == 6  # all 6 taken while it ran, then given back
    count.free = 1  # five cores run other texts' pieces: nothing to cut with
    assert pieces.ids(text) is None and held == [0]
    count.free = 2

    class Failing:
        def encode_batch(self, parts, **kw):
            raise RuntimeError("boom")

    pieces.backend = Failing()
    with pytest.raises(RuntimeError):
        pieces.ids(text)
    assert count.free == 2


def test_a_long_prompt_with_a_bos_is_not_cut_where_special_tokens_are_added(tmp_path, cores):
    """Pieces add no special tokens: where add_special_tokens=True adds a BOS, a whole new
    prompt is the tokenizer's own call, BOS first."""
    tok = _tiny(tmp_path, bos=True)
    plain = copy.deepcopy(tok)
    counts = incremental_tokenizer.install(tok)
    text = "<|im_start|>user\n" + _long_texts(6)[0] + "<|im_end|>"
    got = tok(text, add_special_tokens=True)["input_ids"]
    assert got == plain(text, add_special_tokens=True)["input_ids"]
    assert got[0] == plain.convert_tokens_to_ids("<s>") and counts.pieced_tokens == 0
    assert list(tok(text + "x", add_special_tokens=False)["input_ids"]) == \
        plain(text + "x", add_special_tokens=False)["input_ids"]
    assert counts.pieced_tokens > 0  # without special tokens the same prompt is cut


@pytest.mark.parametrize("which", ["smollm2", "tiny-bos"])
def test_a_later_turns_new_text_is_cut_and_nothing_goes_through_transformers(
        which, tmp_path, cores, monkeypatch):
    """With cores to spare, every turn of a chat gets the plain tokenizer's ids; a later
    turn's new text of a few hundred words is tokenized in pieces, and what is not cut (the
    prompt's last tail, short messages) goes to the Rust tokenizer alone: transformers' own
    call is made only for a new prompt where add_special_tokens=True adds a token (tiny-bos's
    BOS)."""
    tok = _smollm2() if which == "smollm2" else _tiny(tmp_path, bos=True)
    plain = copy.deepcopy(tok)
    counts = incremental_tokenizer.install(tok)
    assert counts is not None
    base = type(plain)
    own_calls: list[bool] = []
    real_call = base.__call__

    def counted(self, *args, **kwargs):
        if self is tok:
            own_calls.append(kwargs.get("add_special_tokens", True))
        return real_call(self, *args, **kwargs)

    monkeypatch.setattr(base, "__call__", counted)
    rng = random.Random(9)
    doc = _long_texts(7)[0]
    for special in (False, True):
        msgs = [{"role": "system", "content": doc + f" ({special})"}]
        for turn in range(3):
            # ~800 characters: more than a piece, less than two pieces of 1,024 (which were
            # needed before a later turn's text was cut at all).
            words = rng.choices(AWKWARD[:3] + ["plain", "words", "of", "the", "user"], k=90)
            msgs.append({"role": "user", "content": " ".join(words)})
            assert 600 < len(msgs[-1]["content"]) < 1000
            text = plain.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            before = counts.pieced_tokens
            got = tok(text, add_special_tokens=special)["input_ids"]
            assert list(got) == real_call(plain, text, add_special_tokens=special)["input_ids"]
            if turn:
                assert counts.pieced_tokens > before, (special, turn)  # the new text was cut
            msgs.append({"role": "assistant", "content": rng.choice(AWKWARD)})
    # tiny-bos: the first prompt with its BOS; its later turns reuse that head.
    assert own_calls == ([True] if which == "tiny-bos" else [])
    pieces = parallel_tokenizing.install(plain)
    for text in AWKWARD:
        assert pieces.whole(text) == real_call(plain, text, add_special_tokens=False)["input_ids"]


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
