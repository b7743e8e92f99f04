"""Chat template and tokenization, done once in the router so the engine receives token ids
and the router can hash exactly the blocks the engine will cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class Templater:
    def __init__(self, model_path: str | Path, trust_remote_code: bool = False) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path),
                                                       trust_remote_code=trust_remote_code)

    def chat(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=False)
        # The template already holds BOS and role markers; adding special tokens again
        # would make the prompt differ from what vLLM's own chat endpoint would build.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def completion(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        return self.tokenizer(prompt)["input_ids"]

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)
