"""A request's spans in the router (metrics/tracing.py): `rayattn.request` from its arrival
to its last byte, and under it `rayattn.route`, the router's own work up to the engine call."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from rayattn.metrics.tracing import Tracing
from rayattn.routing.policies import Decision
from rayattn.server.http.replies import Arrival, Stream


class Spans:
    def __init__(self, tracing: Tracing) -> None:
        self.tracing = tracing

    def opened(self, request: Request, kind: str, arrived: Arrival) -> Any:
        """The request's span, under the client's trace where its headers name one."""
        return self.tracing.tracer.start_span(
            "rayattn.request", context=self.tracing.context_from(request.headers),
            start_time=int(arrived.wall * 1e9),
            attributes={"rayattn.kind": kind, "http.route": request.url.path})

    def answered(self, span: Any, response: Response) -> Response:
        """`response` naming `span` for the client; the span ends with the response (a
        stream's when its last event is out)."""
        span.set_attribute("http.status_code", response.status_code)
        response.headers.update(self.tracing.carrier(span))
        if isinstance(response, Stream):
            response.on_close = span.end
        else:
            span.end()
        return response

    def named(self, span: Any, rid: str, model: str) -> dict[str, str]:
        """The request's id and model on its span; the carrier the engine's spans join."""
        span.set_attribute("rayattn.request_id", rid)
        span.set_attribute("rayattn.model", model)
        return self.tracing.carrier(span)

    def routed(self, parent: Any, d: Decision, arrived: Arrival) -> None:
        """The router's own part of a traced request: from its arrival to the engine call,
        with the decision's account."""
        if not d.dispatched_at:
            return
        # Imported here, as metrics/tracing.py does: only a router with tracing on loads
        # OpenTelemetry (this module is imported whether tracing is on or not).
        from opentelemetry import trace

        start = arrived.wall
        span = self.tracing.tracer.start_span(
            "rayattn.route", context=trace.set_span_in_context(parent),
            start_time=int(start * 1e9), attributes={
                "rayattn.replica": d.replica, "rayattn.route_reason": d.reason,
                "rayattn.predicted_cached_tokens": d.predicted_cached_tokens,
                "rayattn.regret_tokens": d.regret_tokens,
                "rayattn.moved_from": d.moved_from or ""})
        span.end(end_time=int((start + d.dispatched_at - arrived.perf) * 1e9))
