"""What the router sends an engine replica and what comes back, per streamed chunk."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    """Keyword arguments of vllm.SamplingParams (validated by the router)."""


@dataclass
class Chunk:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    num_cached_tokens: int = 0
    completion_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    """On the final chunk: ttft_s, prefill_s, queue_s, e2e_s, path."""
    served_by: dict[str, Any] = field(default_factory=dict)
    """On the final chunk: the engine's own identity (rank name, replica, pid), so clients
    and tests can check where a request really ran, independently of the router."""
