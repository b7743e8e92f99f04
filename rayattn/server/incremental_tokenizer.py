"""Tokenize a conversation's new turn only: the router's tokenizer reuses the ids of the
longest earlier prompt text that the new prompt starts with.

A conversation's next prompt is its previous prompt, the answer and the new message, so most
of every later turn's tokenizing (~1 µs a token, 3 ms for a 2.5k-token prompt, on the
renderer's thread) repeats work already done. A fast (Rust) tokenizer splits its input at
added special tokens before normalizing or merging anything, so where a text is cut right
after such a token, ids(head + tail) == ids(head) + ids(tail). The cut points are the ends of
the chat template's special tokens (`<|im_end|>`, `<|start_header_id|>`, …).

Installed only where that identity holds for the tokenizer at hand: its special tokens strip
no neighbouring whitespace, and a self-test of the identity passes for every boundary token
and both `add_special_tokens` settings. Otherwise (and for any call with other arguments:
offsets, a batch, pairs) the tokenizer runs as vLLM configured it. Since the engine serves the
router's ids (render once), an id off here would change the answer: the tests compare every
result with the plain tokenizer (tests/unit/test_incremental_tokenizer.py)."""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from typing import Any

log = logging.getLogger("rayattn.router")

# Bounds on what the router keeps: the heads of recent prompts, as text (the key) and ids.
MAX_ENTRIES = 4096
MAX_CHARS = 32 * 2**20
MAX_BOUNDARY_TOKENS = 16

_SELF_TEST = ["hello world", " leading space", "\n\nnewlines\n", "ünïcode 漢字 🙂", "",
              "tabs\tand  spaces ", "trailing space ", "x", "  ", "\n"]
_ARGS = frozenset({"add_special_tokens", "truncation", "max_length"})


class HeadCache:
    """Ids of prompt heads (text up to a boundary), least recently used out first."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_chars: int = MAX_CHARS) -> None:
        self._items: OrderedDict[tuple[bool, str], list[int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()  # the renderer tokenizes on a pool of threads
        self.max_entries, self.max_chars = max_entries, max_chars

    def get(self, key: tuple[bool, str]) -> list[int] | None:
        with self._lock:
            ids = self._items.get(key)
            if ids is not None:
                self._items.move_to_end(key)
            return ids

    def put(self, key: tuple[bool, str], ids: list[int]) -> None:
        if len(key[1]) > self.max_chars:
            return
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return
            self._items[key] = ids
            self._chars += len(key[1])
            while len(self._items) > self.max_entries or self._chars > self.max_chars:
                (_, text), _ = self._items.popitem(last=False)
                self._chars -= len(text)

    def __len__(self) -> int:
        return len(self._items)


class Counts:
    def __init__(self) -> None:
        self.reused_tokens = 0
        self.tokenized_tokens = 0


def boundary_tokens(tokenizer: Any) -> list[str]:
    """The tokenizer's special tokens that strip nothing around them: the cut points (none
    where it is not a fast tokenizer with added tokens)."""
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if not isinstance(added, dict):
        return []
    names = sorted({t.content for t in added.values()
                    if getattr(t, "special", False) and t.content
                    and not getattr(t, "lstrip", True) and not getattr(t, "rstrip", True)
                    and not getattr(t, "single_word", True)})
    # The ones the chat template writes are where prompts can be cut (Llama 3 declares 256
    # reserved special tokens; each one cut at is self-tested).
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        names = [n for n in names if n in template]
    return names[:MAX_BOUNDARY_TOKENS]


def _holds(tokenizer: Any, names: list[str]) -> bool:
    """ids(head + token + tail) == ids(head + token) + ids(tail) on awkward texts."""
    def ids(text: str, special: bool) -> list[int]:
        return list(tokenizer(text, add_special_tokens=special)["input_ids"])

    for name in names:
        for head in _SELF_TEST:
            for tail in _SELF_TEST:
                for special in (True, False):
                    if ids(head + name + tail, special) != \
                            ids(head + name, special) + ids(tail, False):
                        log.info("incremental tokenizing off: %s does not split at %r",
                                 type(tokenizer).__name__, name)
                        return False
    return True


def install(tokenizer: Any) -> Counts | None:
    """Make `tokenizer` (vLLM's renderer's, in this process) reuse prompt heads, in place.
    Returns its counters, or None where the identity does not hold (nothing changed)."""
    names = boundary_tokens(tokenizer)
    if not names or not callable(tokenizer):
        return None
    try:
        if not _holds(tokenizer, names):
            return None
    except Exception as e:  # a tokenizer that cannot even do this is left as it is
        log.info("incremental tokenizing off: self-test failed with %r", e)
        return None
    # Longest first: one token's text may contain another's.
    pattern = re.compile("|".join(map(re.escape, sorted(names, key=len, reverse=True))))
    heads, counts = HeadCache(), Counts()
    base = type(tokenizer)

    def __call__(self: Any, text: Any = None, *args: Any, **kwargs: Any) -> Any:
        if args or not isinstance(text, str) or not set(kwargs) <= _ARGS:
            return base.__call__(self, text, *args, **kwargs)
        special = bool(kwargs.get("add_special_tokens", True))
        cuts = [m.end() for m in pattern.finditer(text)]
        if not cuts:
            return base.__call__(self, text, **kwargs)
        head_ids, at = None, 0
        for at in reversed(cuts):
            head_ids = heads.get((special, text[:at]))
            if head_ids is not None:
                break
        if head_ids is None:
            ids = list(base.__call__(self, text, add_special_tokens=special)["input_ids"])
            counts.tokenized_tokens += len(ids)
            at = 0
        else:
            tail = list(base.__call__(self, text[at:], add_special_tokens=False)["input_ids"])
            ids = head_ids + tail
            counts.reused_tokens += len(head_ids)
            counts.tokenized_tokens += len(tail)
        if kwargs.get("truncation") and kwargs.get("max_length") is not None \
                and len(ids) > kwargs["max_length"]:
            # Longer than vLLM lets through: its own call, truncation and error included.
            return base.__call__(self, text, **kwargs)
        last = cuts[-1]
        if last > at:  # the next turn starts from this prompt's last boundary
            tail_len = len(base.__call__(self, text[last:],
                                         add_special_tokens=False)["input_ids"])
            heads.put((special, text[:last]), ids[:len(ids) - tail_len])
        return _encoding(ids)

    layer = type(f"IncrementallyTokenizing{base.__name__}", (base,), {"__call__": __call__})
    tokenizer.__class__ = layer
    tokenizer.rayattn_incremental = counts
    return counts


def _encoding(ids: list[int]) -> Any:
    from transformers import BatchEncoding

    return BatchEncoding({"input_ids": ids})
