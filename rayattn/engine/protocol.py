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
    stream_interval_s: float = 0.0
    """After the first token, merge output deltas into one chunk per this interval
    (infinity: first token, then the rest at the end)."""
    log: bool = False
    """Log one line for this request on the engine (router.log_requests)."""
    origin: str = ""
    """The sending router replica: engines count in-flight requests per origin, so each
    router knows its own share exactly and takes only the others' from the report."""


@dataclass
class Chunk:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    num_cached_tokens: int = 0
    completion_tokens: int = 0
    timings: dict[str, Any] = field(default_factory=dict)
    """On the final chunk: ttft_s, prefill_s, queue_s, e2e_s, itl_s, path, and the prefill's
    span on the engine's clock (scheduled_ts, first_token_ts)."""
    served_by: dict[str, Any] = field(default_factory=dict)
    """On the final chunk: the engine's own identity (rank name, replica, pid), so clients
    and tests can check where a request really ran, independently of the router."""
    inflight_by_origin: dict[str, int] | None = None
    """On the first and the final chunk: the engine's in-flight requests per sending router
    at that moment. Fresher than the periodic probe, which under saturation can lag by
    seconds: with several routers a stale report of the others' load fired the guard."""
    inflight_stamp: tuple[int, int] | None = None
    """(engine pid, change counter) of `inflight_by_origin`, so the newest report wins."""

    def merge(self, later: Chunk) -> None:
        """Append a later delta of the same request to this one."""
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        self.finish_reason = later.finish_reason
        self.num_cached_tokens = later.num_cached_tokens
        self.completion_tokens = later.completion_tokens
        self.timings = later.timings or self.timings
        self.served_by = later.served_by or self.served_by
        if later.inflight_by_origin is not None:
            self.inflight_by_origin = later.inflight_by_origin
            self.inflight_stamp = later.inflight_stamp
