"""OpenTelemetry traces of one request through router and engine (`tracing.otlp_endpoint`).

One trace per request: the client's W3C `traceparent` (or a new trace) is the parent of the
router's `rayattn.request` span; under it `rayattn.route` covers the router's own work up to
the engine call (validation, rendering, the routing decision), and the engine replica adds
`rayattn.engine` with `queue`, `prefill` or `extend`, and `decode` from vLLM's own
timestamps. The router passes its context to the engine inside the call and returns it to
the client in `traceparent`. Spans go to an OTLP/HTTP collector in batches, from a tracer
provider of rayattn's own (vLLM's and Ray's tracing stay as they are). Off by default: then
no tracer exists and no request pays anything.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("rayattn.tracing")

# Spans leave in batches this often (the SDK's default is 5 s).
EXPORT_EVERY_MS = 1000


class Tracing:
    def __init__(self, endpoint: str, service_name: str, role: str) -> None:
        """`endpoint`: OTLP/HTTP traces URL; `role`: `router` or `engine`."""
        # OpenTelemetry: only a process with tracing on loads it (see server/http/spans.py).
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(resource=Resource.create(
            {"service.name": service_name, "rayattn.role": role}))
        self.provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=endpoint),
            schedule_delay_millis=EXPORT_EVERY_MS))
        self.tracer = self.provider.get_tracer("rayattn")
        self.propagator = TraceContextTextMapPropagator()

    def context_from(self, carrier: Mapping[str, str] | None) -> Any:
        """The parent context a W3C carrier (HTTP headers, the router's call) names."""
        return self.propagator.extract(dict(carrier or {}))

    def carrier(self, span: Any) -> dict[str, str]:
        """`traceparent` (and `tracestate`) naming `span`, for the next hop."""
        # OpenTelemetry: loaded only once tracing is on.
        from opentelemetry import trace

        out: dict[str, str] = {}
        self.propagator.inject(out, context=trace.set_span_in_context(span))
        return out

    def engine_spans(self, parent: Mapping[str, str], timings: dict[str, Any],
                     attributes: dict[str, Any], end_wall: float) -> None:
        """The engine's part of a finished request, from vLLM's timings: the whole of it
        in this replica, and its queue, prefill (or extend) and decode phases."""
        ctx = self.context_from(parent)
        end = _ns(end_wall)
        start = _ns(end_wall - timings["e2e_s"])
        queue_end = start + _ns(timings["queue_s"])
        first = queue_end + _ns(timings["prefill_s"])
        span = self.tracer.start_span("rayattn.engine", context=ctx, start_time=start,
                                      attributes=attributes)
        # OpenTelemetry: loaded only once tracing is on.
        from opentelemetry import trace

        inner = trace.set_span_in_context(span)
        for name, a, b in (("queue", start, queue_end), (timings["path"], queue_end, first),
                           ("decode", first, max(first, end))):
            self.tracer.start_span(name, context=inner, start_time=a).end(end_time=b)
        span.end(end_time=end)

    def shutdown(self) -> None:
        try:
            self.provider.shutdown()
        except Exception:  # exporting must never fail the process's shutdown
            log.exception("tracing shutdown failed")


def make(cfg: Any, role: str) -> Tracing | None:
    """From the config's `tracing` section (schema.TracingConfig): None when it is off."""
    return Tracing(cfg.otlp_endpoint, cfg.service_name, role) if cfg.otlp_endpoint else None


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)

