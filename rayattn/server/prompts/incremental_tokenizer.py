"""Tokenize a conversation's new turn only: the router's tokenizer reuses the ids of the
longest earlier prompt text that the new prompt starts with.

A conversation's next prompt is its previous prompt, the answer and the new message, so most
of every later turn's tokenizing (about linear in the prompt's tokens, on the renderer's
thread; docs/log/cpu-router-hop.md) repeats work already done. A fast (Rust) tokenizer
splits its input at added special tokens before normalizing or merging anything, so where a
text is cut right after such a token, ids(head + tail) == ids(head) + ids(tail). The cut
points are the ends of the chat template's special tokens (`<|im_end|>`, `<|start_header_id|>`, …).

Installed only where that identity holds for the tokenizer at hand (`boundary_tokens`: a
fast tokenizer that splits special tokens out; tokens unnormalized, stripping nothing, not
overlapping other added tokens) and a self-test of it passes for every cut token, awkward
tails (punctuation, combining marks, other special tokens) and both `add_special_tokens`
settings. Otherwise (and for any call with other arguments: offsets, a batch, pairs, HF's
implied truncation) the tokenizer runs as vLLM configured it. Since the engine serves the
router's ids (render once), an id off here would change the answer: the tests compare every
result with the plain tokenizer (tests/unit/server/prompts/test_incremental_tokenizer.py).
What is still tokenized (a new prompt, a long new turn) goes in pieces on several cores where
parallel_tokenizing.py finds that exact too."""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from array import array
from collections import OrderedDict
from typing import Any

from rayattn.integrations import patches
from rayattn.server.prompts import parallel_tokenizing

log = logging.getLogger("rayattn.router")

# Bounds on what the router keeps per model: the ids of recent prompts' heads.
MAX_ENTRIES = 4096
MAX_BYTES = 64 * 2**20
MAX_BOUNDARY_TOKENS = 16

_SELF_TEST = ["hello world", " leading space", "\n\nnewlines\n", "ünïcode 漢字 🙂", "",
              "tabs\tand  spaces ", "trailing space ", "x", "  ", "\n", ".", "'s", ">>",
              '"quoted"', "123", "\u0338x", "-->"]
_ARGS = frozenset({"add_special_tokens", "truncation", "max_length"})

Key = tuple[bool, bytes]
"""(add_special_tokens, digest of the head's text)."""


class HeadCache:
    """Ids of prompt heads (text up to a boundary), least recently used out first."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self._items: OrderedDict[Key, array] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # the renderer tokenizes on a pool of threads
        self.max_entries, self.max_bytes = max_entries, max_bytes

    def get(self, key: Key) -> array | None:
        with self._lock:
            ids = self._items.get(key)
            if ids is not None:
                self._items.move_to_end(key)
            return ids

    def put(self, key: Key, ids: array) -> None:
        size = _size(ids)
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return
            self._items[key] = ids
            self._bytes += size
            while len(self._items) > self.max_entries or self._bytes > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self._bytes -= _size(old)

    def __len__(self) -> int:
        return len(self._items)


def _size(ids: array) -> int:
    return ids.itemsize * len(ids) + 64  # the key and the entry's own overhead, roughly


class Counts:
    def __init__(self) -> None:
        self.reused_tokens = 0
        self.tokenized_tokens = 0
        self.pieced_tokens = 0
        """Of tokenized_tokens, those tokenized in pieces on several cores."""
        self._lock = threading.Lock()

    def add(self, reused: int, tokenized: int, pieced: int = 0) -> None:
        with self._lock:
            self.reused_tokens += reused
            self.tokenized_tokens += tokenized
            self.pieced_tokens += pieced


def boundary_tokens(tokenizer: Any) -> list[str]:
    """The special tokens a prompt may be cut after: matched whole before anything else
    (a fast tokenizer that splits special tokens out, the token unnormalized, stripping
    nothing around it, contained in no other added token and containing none, and
    tokenized alone as its own id). Where the chat template is known, only the ones it
    writes (Llama 3 declares 256 reserved special tokens; each cut point is self-tested)."""
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if not isinstance(added, dict) or not getattr(tokenizer, "is_fast", False) \
            or getattr(tokenizer, "split_special_tokens", False):
        return []
    contents = {t.content for t in added.values()}
    template = getattr(tokenizer, "chat_template", None)
    names = []
    for tid, t in sorted(added.items()):
        name = t.content
        if not (getattr(t, "special", False) and name) or any(
                getattr(t, flag, True) for flag in ("normalized", "lstrip", "rstrip",
                                                    "single_word")):
            continue
        if any(other != name and (name in other or other in name) for other in contents):
            continue
        if isinstance(template, str) and name not in template:
            continue
        if list(tokenizer(name, add_special_tokens=False)["input_ids"]) != [tid]:
            continue
        names.append(name)
    return names[:MAX_BOUNDARY_TOKENS]


def _holds(tokenizer: Any, names: list[str]) -> bool:
    """ids(head + token + tail) == ids(head + token) + ids(tail) on awkward texts."""
    def ids(text: str, special: bool) -> list[int]:
        return list(tokenizer(text, add_special_tokens=special)["input_ids"])

    tails = _SELF_TEST + [n + "x" for n in names]
    for name in names:
        for head in _SELF_TEST:
            for tail in tails:
                for special in (True, False):
                    if ids(head + name + tail, special) != \
                            ids(head + name, special) + ids(tail, False):
                        log.info("incremental tokenizing off: %s does not split at %r",
                                 type(tokenizer).__name__, name)
                        return False
    return True


def _head_keys(text: str, cuts: list[int], special: bool) -> list[Key]:
    """The key of each head text[:cut], chained so the whole prompt is hashed once
    (a prompt may hold thousands of cut points: a user can type the special tokens)."""
    h = hashlib.blake2b(digest_size=16)
    keys, prev = [], 0
    for cut in cuts:
        h.update(text[prev:cut].encode("utf-8", "surrogatepass"))
        prev = cut
        keys.append((special, h.copy().digest()))
    return keys


def _plain(kwargs: dict[str, Any]) -> bool:
    """Arguments whose result is the ids themselves, or their prefix cut at `max_length`
    (what vLLM passes: truncation exactly where a limit is given). Others (HF's implied
    truncation at `model_max_length`, truncation strategies) are the tokenizer's own."""
    trunc, limit = kwargs.get("truncation"), kwargs.get("max_length")
    return (trunc in (None, False) and limit is None) or \
        (trunc is True and isinstance(limit, int))


def install(tokenizer: Any) -> Counts | None:
    """Make `tokenizer` (vLLM's renderer's, in this process) reuse prompt heads, in place
    (a class swap: the run-time patch `incremental_tokenizer`, rayattn/integrations/patches.py).
    Returns its counters, or None where the identity does not hold (nothing changed)."""
    if not callable(tokenizer):
        return None
    try:
        names = boundary_tokens(tokenizer)
        if not names or not _holds(tokenizer, names):
            return None
    except Exception as e:  # a tokenizer that cannot even do this is left as it is
        log.info("incremental tokenizing off: self-test failed with %r", e)
        return None
    # Longest first: one token's text may contain another's.
    pattern = re.compile("|".join(map(re.escape, sorted(names, key=len, reverse=True))))
    reuse = _HeadReuse(type(tokenizer), pattern, parallel_tokenizing.install(tokenizer),
                       tokenizer)

    def __call__(self: Any, text: Any = None, *args: Any, **kwargs: Any) -> Any:
        return reuse.call(self, text, *args, **kwargs)

    patches.swap_tokenizer_call(tokenizer, __call__)
    return reuse.counts


class _HeadReuse:
    """The swapped-in __call__'s work: a prompt's ids are a known head's (up to its last
    boundary token) plus the rest's, tokenized alone."""

    def __init__(self, base: type, pattern: re.Pattern[str], piece_tokenizer: Any,
                 tokenizer: Any) -> None:
        self.base, self.pattern, self.piece_tokenizer = base, pattern, piece_tokenizer
        self.heads, self.counts = HeadCache(), Counts()
        # Where add_special_tokens=True adds nothing, a text's ids are the same either way:
        # it may be tokenized in pieces or whole by the piece tokenizer's backend (neither
        # adds any).
        self.adds_nothing = piece_tokenizer is not None and \
            list(base.__call__(tokenizer, "x", add_special_tokens=True)["input_ids"]) == \
            list(base.__call__(tokenizer, "x", add_special_tokens=False)["input_ids"])

    def own_ids(self, tok: Any, text: str, special: bool) -> tuple[list[int], bool]:
        """The tokenizer's own ids for text, and whether they were tokenized in pieces."""
        if self.piece_tokenizer is not None and (self.adds_nothing or not special):
            ids = self.piece_tokenizer.ids(text)
            if ids is not None:
                return ids, True
            return self.piece_tokenizer.whole(text), False
        return list(self.base.__call__(tok, text, add_special_tokens=special)["input_ids"]), \
            False

    def call(self, tok: Any, text: Any = None, *args: Any, **kwargs: Any) -> Any:
        base = self.base
        if args or not isinstance(text, str) or not set(kwargs) <= _ARGS \
                or not _plain(kwargs):
            return base.__call__(tok, text, *args, **kwargs)
        special = bool(kwargs.get("add_special_tokens", True))
        cuts = [m.end() for m in self.pattern.finditer(text)]
        if not cuts:
            return base.__call__(tok, text, **kwargs)
        keys = _head_keys(text, cuts, special)
        head, at = self._known_head(keys, cuts)
        if head is None:
            ids, pieced = self.own_ids(tok, text, special)
            self.counts.add(0, len(ids), len(ids) if pieced else 0)
        else:
            tail, pieced = self.own_ids(tok, text[at:], False)
            ids = head.tolist() + tail
            self.counts.add(len(head), len(tail), len(tail) if pieced else 0)
        limit = kwargs.get("max_length") if kwargs.get("truncation") else None
        if limit is not None and len(ids) > limit:
            # Longer than vLLM lets through: its own call, truncation and error included.
            return base.__call__(tok, text, **kwargs)
        if cuts[-1] > at:  # the next turn starts from this prompt's last boundary
            tail_len = len(self.own_ids(tok, text[cuts[-1]:], False)[0])
            self.heads.put(keys[-1], array("i", ids[:len(ids) - tail_len]))
        return _encoding(ids)

    def _known_head(self, keys: list[Key], cuts: list[int]) -> tuple[array | None, int]:
        """The longest known head of the text and where it ends (None, 0: none known)."""
        for i in range(len(cuts) - 1, -1, -1):
            head = self.heads.get(keys[i])
            if head is not None:
                return head, cuts[i]
        return None, 0


def _encoding(ids: list[int]) -> Any:
    from transformers import BatchEncoding

    return BatchEncoding({"input_ids": ids, "attention_mask": [1] * len(ids)})
