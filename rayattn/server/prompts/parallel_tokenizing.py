"""Tokenize one long text in pieces on several cores, with the ids of tokenizing it whole.

A new conversation's prompt (a document, a long tool output) is tokenized in full by the
router; one fast tokenizer call is single-threaded and linear in the tokens (most of it the
pre-tokenizer's regex), so a document-sized prompt costs milliseconds of the router's hop
however many cores the host has. Cut into pieces, `encode_batch` runs them on the Rust tokenizer's
thread pool and releases the GIL.

Where the ids stay exact: a fast tokenizer takes added tokens out, normalizes the text,
splits it into pre-tokens, then runs the model (BPE, …) on each pre-token alone. With no
normalizer or NFC, and a pre-tokenizer that splits by a regex and maps bytes (GPT-2's
ByteLevel, or the Split + ByteLevel of Llama 3, Qwen, DeepSeek), a cut where the
pre-tokenizer starts a pre-token anyway is invisible to the model. The cuts taken are
between a letter and a single space followed by a letter (`abc| def`), where those regexes
end a letter run and start ` def`; a regex that looks behind or joins words (`New York`)
would not, and the self-test, not this reasoning, is what catches one. Installed only where:
- the tokenizer has that shape: no normalizer but NFC; byte-level, regex-split and digit
  steps only, one of them splitting by a regex; no space prepended; added tokens hold no
  whitespace and take none around them (lstrip, rstrip, single_word: conservative, only
  rstrip could lose a space at a cut) and are not split as text (`split_special_tokens`);
- on self-test texts in several scripts, the pre-tokenizer starts a pre-token at every cut,
  and 2, 3 and 7 pieces give the tokenizer's own ids."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import threading
from itertools import pairwise
from typing import Any

log = logging.getLogger("rayattn.router")

MIN_CUT_CHARS = 512
"""Texts from here are cut, in two at least. A hand-off to the thread pool costs microseconds,
a token about one, so halves tokenized side by side already beat the whole text at this
length on two free cores (docs/log/cpu-router-hop.md). So a later turn's new text
(a few thousand characters) is cut too, not only a new document."""

PIECE_CHARS = 1024
"""One piece per this many characters of a longer text, as the free cores allow. Smaller
pieces of a new document gained nothing where many prompts arrive at once and several router
processes' Rust pools share the cores: the hand-offs cost what the extra parallelism saves
(docs/log/cpu-router-hop.md)."""

_CUT = re.compile(r"(?<=[^\W\d_]) (?=[^\W\d_])")
"""Candidates for a cut: one plain space (U+0020) between word characters that are not
digits. Only letters are kept (isalpha): a regex that groups digits (`\\p{N}{1,3}`) or
punctuation with what follows could join them across the space."""

_STEPS = frozenset({"ByteLevel", "Split", "Digits"})


def _normalizer_ok(spec: dict[str, Any] | None) -> bool:
    """None, an empty sequence (DeepSeek-V3), or NFC (Qwen): NFC composes a character only
    with the marks and starters that follow it, and nothing composes with a space, so it
    normalizes `abc` and ` def` as it does `abc def`."""
    if spec is None or spec.get("type") == "NFC":
        return True
    return spec.get("type") == "Sequence" and all(
        _normalizer_ok(n) for n in spec.get("normalizers", []))


def _shape_ok(spec: dict[str, Any], tokenizer: Any) -> bool:
    if not _normalizer_ok(spec.get("normalizer")) or \
            getattr(tokenizer, "split_special_tokens", False):
        return False
    for t in spec.get("added_tokens", []):
        if any(c.isspace() for c in t.get("content", "")) or \
                any(t.get(k) for k in ("lstrip", "rstrip", "single_word")):
            return False
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if not steps or any(s.get("type") not in _STEPS for s in steps):
        return False  # nested or empty sequences, Metaspace, Whitespace, …
    splits_by_regex = False
    for s in steps:
        if s["type"] == "ByteLevel":
            if s.get("add_prefix_space"):
                return False  # a text not starting with a space gets one: not a piece's
            splits_by_regex |= bool(s.get("use_regex", True))
        elif s["type"] == "Split":
            if s.get("invert") or s.get("behavior") != "Isolated":
                return False
            splits_by_regex = True
    return splits_by_regex


def cut_points(text: str, pieces: int) -> list[int]:
    """Up to pieces - 1 offsets, about evenly spaced, each between a letter and ` <letter>`."""
    out: list[int] = []
    step = len(text) // max(pieces, 1)
    for k in range(1, pieces):
        start = max(k * step, out[-1] + 1 if out else 1)
        for m in _CUT.finditer(text, start):
            i = m.start()
            if text[i - 1].isalpha() and text[i + 1].isalpha():
                out.append(i)
                break
        else:
            break  # none after this start, so none after any later one
    return out


def process_cores() -> int:
    """The CPUs this process may run on (its affinity mask, not cgroup quotas)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _cores() -> int:
    """The cores the Rust tokenizer's pool may use here: this process's CPUs, bounded by
    RAYON_NUM_THREADS; 1 where TOKENIZERS_PARALLELISM turns the pool off."""
    setting = os.environ.get("TOKENIZERS_PARALLELISM")
    if setting is not None and setting.lower() in ("", "off", "false", "f", "no", "n", "0"):
        return 1  # as the tokenizers library reads it
    cores = process_cores()
    limit = os.environ.get("RAYON_NUM_THREADS", "")
    return min(cores, int(limit)) if limit.isdigit() and int(limit) > 0 else cores


class _Cores:
    """Cores not running a piece now, for the whole process (the Rust tokenizer's thread
    pool is one per process, whatever the models): texts tokenized at once share them, so
    64 new prompts arriving together are not each cut 16 ways onto 16 cores."""

    def __init__(self) -> None:
        self.free = _cores()
        self.lock = threading.Lock()

    def take(self, want: int) -> int:
        with self.lock:
            n = min(want, self.free)
            if n < 2:
                return 0
            self.free -= n
            return n

    def give(self, n: int) -> None:
        with self.lock:
            self.free += n


CORES = _Cores()


class PieceTokenizer:
    """Tokenizes long texts in pieces on the Rust tokenizer's thread pool; `ids` returns
    None where a text is better tokenized the usual way."""

    def __init__(self, spec: str) -> None:
        # tokenizers comes with vLLM: only a router that renders prompts loads it.
        from tokenizers import Tokenizer

        # A copy of its own, only ever read: transformers' __call__ sets truncation and
        # padding on the tokenizer's own backend, which would then apply here too.
        self.backend = Tokenizer.from_str(spec)
        self.backend.no_truncation()
        self.backend.no_padding()

    def ids(self, text: str) -> list[int] | None:
        """The ids of `text` (no special tokens added), or None where it is too short to be
        worth cutting, fewer than two cores are free or it has no place to cut (tokenize it
        whole)."""
        if len(text) < MIN_CUT_CHARS:
            return None  # a short tail: no lock on the router's request path
        n = CORES.take(max(2, len(text) // PIECE_CHARS))
        if not n:
            return None
        try:
            cuts = cut_points(text, n)
            return self.encode(text, cuts) if cuts else None
        finally:
            CORES.give(n)

    def whole(self, text: str) -> list[int]:
        """The ids of `text` (no special tokens added) in one call of the Rust tokenizer: for
        a tokenizer `install` took, what transformers' call returns, without its Python
        around it (which costs as much as tokenizing a short tail). One piece through
        `encode_batch`, as transformers calls it: the backend's `encode` would hold the GIL
        while it tokenizes, and a new document the cores leave uncut takes milliseconds, in
        which the router's event loop and its other renderer threads must run."""
        return self.encode(text, [])

    def encode(self, text: str, cuts: list[int]) -> list[int]:
        bounds = [0, *cuts, len(text)]
        out: list[int] = []
        for enc in self.backend.encode_batch([text[a:b] for a, b in pairwise(bounds)],
                                             add_special_tokens=False):
            out.extend(enc.ids)
        return out


def _self_test_texts() -> list[str]:
    rng = random.Random(11)
    words = ["plain", "words", "ünïcode", "漢字", "🙂", "it's", "they'll", "x", "123", "4.5",
             "a,b", "(paren)", "--", "\n", "\n\n", "\t", "  ", "<|im_end|>", "'s", "é", "̸x",
             "ǅemal", "ʰa", "Привет", "Ελληνικά", "مرحبا", "नमस्ते", "한국어", "ÀÉÎ", "of the"]
    texts = []
    for n in (600, 2500):  # below the usual model's length limit (transformers warns past it)
        texts.append(" ".join(rng.choice(words) for _ in range(n)))
        texts.append("".join(rng.choice(words) + rng.choice(["", " ", "  ", "\n"])
                             for _ in range(n)))
    texts.append("word " * 1500)
    return texts


def install(tokenizer: Any) -> PieceTokenizer | None:
    """A PieceTokenizer for `tokenizer` (a transformers fast tokenizer), or None where its
    ids could differ from the tokenizer's own or no second core is there to use."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or _cores() < 2 or not hasattr(backend, "encode_batch"):
        return None
    try:
        spec = backend.to_str()
        if not _shape_ok(json.loads(spec), tokenizer):
            return None
        piece_tokenizer = PieceTokenizer(spec)
        norm = piece_tokenizer.backend.normalizer
        pre = piece_tokenizer.backend.pre_tokenizer
        for text in _self_test_texts():
            normalized = norm.normalize_str(text) if norm is not None else text
            starts = {a for _, (a, _) in pre.pre_tokenize_str(normalized)}
            own = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            if piece_tokenizer.whole(text) != own:
                log.info("tokenizing in pieces off: %s's backend alone gives other ids",
                         type(tokenizer).__name__)
                return None
            for n in (2, 3, 7):
                if not set(cut_points(normalized, n)) <= starts:
                    log.info("tokenizing in pieces off: %s starts no pre-token at a cut",
                             type(tokenizer).__name__)
                    return None
                if piece_tokenizer.encode(text, cut_points(text, n)) != own:
                    log.info("tokenizing in pieces off: %s gives other ids in pieces",
                             type(tokenizer).__name__)
                    return None
    except Exception as e:  # an unusual tokenizer is tokenized whole
        log.info("tokenizing in pieces off: self-test failed with %r", e)
        return None
    return piece_tokenizer
