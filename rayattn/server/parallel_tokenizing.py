"""Tokenize one long text in pieces on several cores, with the ids of tokenizing it whole.

A new conversation's prompt (a document, a long tool output) is tokenized in full by the
router; one fast tokenizer call is single-threaded (~1.5 µs a token here, most of it the
pre-tokenizer's regex), so a 2k-token prompt costs milliseconds of the router's hop however
many cores the host has. Cut into pieces, `encode_batch` runs them on the Rust tokenizer's
thread pool and releases the GIL.

Where the ids stay exact: a fast tokenizer normalizes the whole text, splits it into
pre-tokens, then runs the model (BPE, …) on each pre-token alone. With no normalizer, and a
pre-tokenizer that only splits by a regex and maps bytes (GPT-2's ByteLevel, or the
Split + ByteLevel of Llama 3, Qwen, DeepSeek), a cut where every such regex ends a match and
starts the next is invisible to the model. The cuts taken are the ones every such regex
honours: a letter, then a single space and a letter (`abc| def`: the letter run ends, and
` def` is one pre-token). Added tokens must hold no whitespace and take none around them
(lstrip, rstrip, single_word). Installed only where the tokenizer is of that shape and a
self-test on awkward texts gives the whole text's ids for every piece count."""

from __future__ import annotations

import json
import logging
import os
import random
from typing import Any

log = logging.getLogger("rayattn.router")

MIN_PIECE_CHARS = 1024
"""~250 tokens: smaller pieces cost more in hand-offs to the thread pool than they save."""

_ALLOWED_PRE_TOKENIZERS = frozenset({"ByteLevel", "Split", "Sequence", "Digits"})


def _shape_ok(backend: Any) -> bool:
    spec = json.loads(backend.to_str())
    if spec.get("normalizer") is not None:
        return False
    for t in spec.get("added_tokens", []):
        # Whitespace inside a token, or a token that takes the whitespace around it: a cut
        # could fall inside one, or leave it without the space it would have taken.
        if any(c.isspace() for c in t.get("content", "")) or \
                any(t.get(k) for k in ("lstrip", "rstrip", "single_word")):
            return False
    pre = spec.get("pre_tokenizer")
    parts = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre]
    for p in parts:
        if not p or p.get("type") not in _ALLOWED_PRE_TOKENIZERS:
            return False
        if p.get("type") == "ByteLevel" and p.get("add_prefix_space"):
            return False  # a space before every piece, not only the first
        if p.get("type") == "Split" and (p.get("invert") or p.get("behavior") != "Isolated"):
            return False
    return True


def cut_points(text: str, pieces: int) -> list[int]:
    """Up to pieces - 1 offsets, about evenly spaced, each between a letter and ` <letter>`."""
    out: list[int] = []
    step = len(text) // pieces
    for k in range(1, pieces):
        i = max(k * step, out[-1] + 1 if out else 1)
        while i < len(text) - 1:
            i = text.find(" ", i)
            if i < 1 or i >= len(text) - 1:
                break
            if text[i - 1].isalpha() and text[i + 1].isalpha():
                out.append(i)
                break
            i += 1
    return out


class PieceTokenizer:
    def __init__(self, backend: Any, threads: int) -> None:
        # A copy of its own, only ever read: transformers' __call__ sets truncation and
        # padding on the tokenizer's own backend, which would then apply here too.
        self._backend = type(backend).from_str(backend.to_str())
        self._backend.no_truncation()
        self._backend.no_padding()
        self.threads = threads

    def ids(self, text: str) -> list[int] | None:
        """The ids of `text` (no special tokens added), or None where it is too short to
        be worth cutting (tokenize it the usual way)."""
        pieces = min(self.threads, len(text) // MIN_PIECE_CHARS)
        if pieces < 2:
            return None
        cuts = cut_points(text, pieces)
        if not cuts:
            return None
        bounds = [0, *cuts, len(text)]
        parts = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        out: list[int] = []
        for enc in self._backend.encode_batch(parts, add_special_tokens=False):
            out.extend(enc.ids)
        return out


def _self_test_texts() -> list[str]:
    rng = random.Random(11)
    words = ["plain", "words", "ünïcode", "漢字", "🙂", "it's", "they'll", "x", "123", "4.5",
             "a,b", "(paren)", "--", "\n", "\n\n", "\t", "  ", "<|im_end|>", "'s", "é", "̸x"]
    texts = []
    for n in (600, 2500, 9000):
        texts.append(" ".join(rng.choice(words) for _ in range(n)))
        texts.append("".join(rng.choice(words) + rng.choice(["", " ", "  ", "\n"])
                             for _ in range(n)))
    texts.append("word " * 3000)
    return texts


def install(tokenizer: Any) -> PieceTokenizer | None:
    """A PieceTokenizer for `tokenizer` (a transformers fast tokenizer), or None where its
    ids could differ from tokenizing whole or only one core is there to use."""
    backend = getattr(tokenizer, "_tokenizer", None)
    threads = _cores()
    if backend is None or threads < 2 or not hasattr(backend, "encode_batch"):
        return None
    try:
        if not _shape_ok(backend):
            return None
        pieces = PieceTokenizer(backend, threads)
        backend = pieces._backend
        for text in _self_test_texts():
            whole = backend.encode(text, add_special_tokens=False).ids
            for n in (2, 3, 7):
                cuts = cut_points(text, n)
                bounds = [0, *cuts, len(text)]
                got = [i for a, b in zip(bounds, bounds[1:], strict=False)
                       for i in backend.encode(text[a:b], add_special_tokens=False).ids]
                if got != whole:
                    log.info("tokenizing in pieces off: %s differs at a cut", type(tokenizer))
                    return None
    except Exception as e:  # an unusual tokenizer is tokenized whole
        log.info("tokenizing in pieces off: self-test failed with %r", e)
        return None
    return pieces


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
