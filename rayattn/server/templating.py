"""Chat template and tokenization, done once in the router so the engine receives token ids
and the router can hash exactly the blocks the engine will cache."""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("rayattn.ingress")


class Templater:
    def __init__(self, model_path: str | Path, trust_remote_code: bool = False,
                 cache_pieces: int = 1024) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path),
                                                       trust_remote_code=trust_remote_code)
        # Tokenizing a 2k-token prompt costs milliseconds, and the router does it for every
        # request. A chat prompt is mostly text seen before (system prompt, earlier turns)
        # between special tokens, which the tokenizer splits on before anything else, so
        # pieces between special tokens are encoded once and cached. Used only where it
        # reproduces the plain encoding exactly (checked below).
        added = sorted({t.content for t in self.tokenizer.added_tokens_decoder.values()},
                       key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, added)) + ")") \
            if added else None
        self._piece = functools.lru_cache(maxsize=cache_pieces)(self._encode_plain)
        if self._split is not None and not self._segments_exact():
            log.warning("tokenizer of %s does not split on special tokens independently: "
                        "prompt pieces are not cached", model_path)
            self._split = None

    def _encode_plain(self, text: str) -> tuple[int, ...]:
        # The template already holds BOS and role markers; adding special tokens again
        # would make the prompt differ from what vLLM's own chat endpoint would build.
        return tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return list(self._encode_plain(text))
        ids: list[int] = []
        for piece in self._split.split(text):
            if piece:
                ids.extend(self._piece(piece))
        return ids

    def _segments_exact(self) -> bool:
        msgs = [{"role": "system", "content": " You are terse.\n"},
                {"role": "user", "content": "Hello  there!\n\n Tab\there, ünïcode 123."},
                {"role": "assistant", "content": " Fine. "},
                {"role": "user", "content": "again"}]
        try:
            text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                      tokenize=False)
        except Exception:
            text = "".join(m["content"] for m in msgs)
        return self.encode(text) == list(self._encode_plain(text))

    def chat(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=False)
        return self.encode(text)

    def completion(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        return self.tokenizer(prompt)["input_ids"]

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)
