"""What each request did inside the engine, seen from the engine's own outputs.

vLLM's OpenAI serving layer (rayattn/engine/openai_layer.py) builds the response; it never
tells its caller how long the prefill took, how much of the prompt was cached or which
tokens came out. `ObservedEngine` stands in for the AsyncLLM it calls: every `generate`
passes through unchanged while the request's `Observation` (found through a context
variable the replica sets around the call) records the first token, the cached prefix, the
generated ids and vLLM's own timestamps. The router learns from that (cost model, index of
multi-turn continuations) and the per-path metrics come from it.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

log = logging.getLogger("rayattn.engine")

current: contextvars.ContextVar[Observation | None] = contextvars.ContextVar(
    "rayattn_observation", default=None)


class Observation:
    """One client request: one engine request, or several for a completion with a list of
    prompts (their counts add up; token ids and timings are the first one's)."""

    def __init__(self, engine_rank: int | None = None) -> None:
        self.engine_rank = engine_rank
        """The DP rank the router chose for this request (None: vLLM's balancer picks)."""
        self.start = time.monotonic()
        self.first_token_at: float | None = None
        self.prompt_tokens = 0
        self.num_cached_tokens = 0
        self.completion_tokens = 0
        self.token_ids: list[int] = []
        """Generated ids of the first prompt's first choice (what the router indexes)."""
        self.timings: dict[str, Any] = {}
        self.requests = 0
        self.outputs = 0
        self.finished = 0
        """Engine outputs seen so far (the first carries the first token)."""
        self.rendered_by_router = False

    def output(self, out: Any, first_request: bool) -> None:
        self.outputs += 1
        ids = sum((len(c.token_ids) for c in out.outputs), 0)
        self.completion_tokens += ids
        if ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if first_request:
            # With n > 1 a streamed output holds whichever choices advanced: take choice 0's.
            for c in out.outputs:
                if getattr(c, "index", 0) == 0:
                    self.token_ids.extend(c.token_ids)
        if out.finished:
            self.finished += 1
            prompt = len(out.prompt_token_ids or [])
            self.prompt_tokens += prompt
            self.num_cached_tokens += out.num_cached_tokens or 0
            if first_request:
                self.timings = timings(out, self.start, self.first_token_at,
                                       len(self.token_ids))


    @property
    def done(self) -> bool:
        """Every engine request of this client request has finished."""
        return self.requests > 0 and self.finished >= self.requests


class ObservedEngine:
    """The AsyncLLM, with `generate` observed; everything else is the engine's own."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        obs = current.get()
        first_request = False
        if obs is not None:
            first_request = obs.requests == 0
            obs.requests += 1
            if obs.engine_rank is not None:
                # vLLM's serving layer passes the rank it read from a header (None here).
                kwargs["data_parallel_rank"] = obs.engine_rank
        async for out in self._engine.generate(*args, **kwargs):
            if obs is not None:
                try:
                    obs.output(out, first_request)
                except Exception:  # observing must never fail a request
                    log.exception("observing an engine output failed")
            yield out


def timings(out: Any, start: float, first: float | None, generated: int) -> dict[str, Any]:
    now = time.monotonic()
    m = out.metrics  # RequestStateStats: *_ts share the engine core's monotonic clock
    ttft = (first or now) - start
    # A non-streamed request's outputs come once, at the end (vLLM's FINAL_ONLY): the engine's
    # own arrival-to-first-token latency is the truth there.
    if m is not None and getattr(m, "first_token_latency", 0) > 0:
        ttft = min(ttft, m.first_token_latency)
    queue = prefill = 0.0
    itl = None
    if m is not None and getattr(m, "scheduled_ts", 0):
        queue = max(0.0, m.scheduled_ts - m.queued_ts)
        prefill = max(0.0, m.first_token_ts - m.scheduled_ts) if m.first_token_ts else 0.0
        if generated > 1 and m.last_token_ts > m.first_token_ts:
            itl = (m.last_token_ts - m.first_token_ts) / (generated - 1)
    return {"ttft_s": ttft, "prefill_s": prefill, "queue_s": queue, "e2e_s": now - start,
            "itl_s": itl, "path": "extend" if out.num_cached_tokens else "prefill",
            # The prefill's span on the engine core's clock, so routers can measure the
            # engine's throughput over overlapping requests (routing/policies/cost_model.py).
            "scheduled_ts": getattr(m, "scheduled_ts", 0.0) or 0.0,
            "first_token_ts": getattr(m, "first_token_ts", 0.0) or 0.0}
