"""What the router sends an engine replica and what comes back, item by streamed item."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class OpenAIRequest:
    kind: Literal["chat", "completion"]
    body: dict[str, Any]
    """The client's JSON body, validated by the router with vLLM's own request model; its
    `request_id` is the request's id (x-request-id), which vLLM prefixes into the engine
    request id and the response's `id`."""
    request_id: str
    stream_interval_s: float = 0.0
    """A streamed response's SSE events are merged into one item per this interval after
    the first (each item is a Ray streaming message through three processes)."""
    log: bool = False
    """Log one line for this request on the engine (router.log_requests)."""
    origin: str = ""
    """The sending router replica: engines count in-flight requests per origin, so each
    router knows its own share exactly and takes only the others' from the report."""


@dataclass
class Reply:
    data: str
    """SSE text (one or more `data: …` events) of a streamed response; the whole JSON body
    of a non-streamed one or of an error."""
    status: int = 200
    """HTTP status: vLLM's own for its errors (ErrorResponse.error.code)."""
    final: bool = False
    prompt_tokens: int = 0
    num_cached_tokens: int = 0
    completion_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    """On the final item: the generated ids of the first choice (the router indexes the
    conversation's continuation from them)."""
    timings: dict[str, Any] = field(default_factory=dict)
    """On the final item of a request that ran: ttft_s, prefill_s, queue_s, e2e_s, itl_s,
    path, and the prefill's span on the engine's clock (scheduled_ts, first_token_ts)."""
    served_by: dict[str, Any] = field(default_factory=dict)
    """On the final item: the engine's own identity (replica id, rank, pid), so clients
    and tests can check where a request really ran, independently of the router."""
    inflight_by_origin: dict[str, int] | None = None
    """On the first and the final item: the engine's in-flight requests per sending router
    at that moment. Fresher than the periodic probe, which under saturation can lag by
    seconds: with several routers a stale report of the others' load fired the guard."""
    inflight_stamp: tuple[int, int] | None = None
    """(engine pid, change counter) of `inflight_by_origin`, so the newest report wins."""


class Misrouted(RuntimeError):
    """Raised by an engine replica for a call aimed at another replica (it left, or was
    replaced, between the router's choice and the call's delivery): the router routes the
    request again (routing/pinning.py)."""
