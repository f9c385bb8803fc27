"""OpenTelemetry tracing of requests, off unless ``--otlp-endpoint`` is set.

One span per API request (``llmgate.request``), a child of the client's
trace when it sends a W3C ``traceparent`` header, with the request id,
model and route as attributes and an event at each step of its life:
``queued`` (no free slot: it waits), ``routed`` (sent to a worker),
``retry`` (its worker was lost before any output), ``first_token``. The
span's context goes to the worker with the request (``Generate.trace``),
and from there to vLLM, whose own spans join the same trace when the
worker is started with vLLM's ``--otlp-traces-endpoint`` (``llmgate serve
--otlp-endpoint`` passes it on).

Spans are exported over OTLP, gRPC by default or HTTP with
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``, as vLLM does. With
tracing off nothing here runs per request (``TRACER`` stays None).
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Sequence
from typing import Any

from shared.redact import redact_url

log = logging.getLogger(__name__)

SERVICE_NAME = "llmgate-gateway"
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"

# The tracer once tracing is set up; None: off.
TRACER: Any = None


def setup(endpoint: str) -> None:
    """Export spans to ``endpoint`` from now on (no-op for an empty endpoint)."""
    global TRACER
    if not endpoint:
        return
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise ValueError(
            "--otlp-endpoint needs the OpenTelemetry SDK: pip install 'llmgate[tracing]'"
        ) from exc
    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
    provider.add_span_processor(BatchSpanProcessor(_exporter(endpoint)))
    atexit.register(provider.shutdown)
    TRACER = provider.get_tracer("llmgate.gateway")
    log.info("tracing requests to %s", redact_url(endpoint))


def _exporter(endpoint: str) -> Any:
    protocol = os.environ.get(PROTOCOL_ENV, "grpc")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, insecure=True)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        return HttpExporter(endpoint=endpoint)
    raise ValueError(f"{PROTOCOL_ENV}={protocol!r}: use grpc or http/protobuf")


def request_span(
    headers: list[tuple[bytes, bytes]], request_id: str, model: str, route: str, stream: bool
) -> RequestSpan:
    """The span of a request that starts now (a shared do-nothing one when tracing is off)."""
    if TRACER is None:
        return NO_SPAN
    attributes = {
        "llmgate.request_id": request_id,
        "gen_ai.request.model": model,
        "http.route": route,
        "llmgate.stream": stream,
    }
    return RequestSpan(headers, attributes)


class RequestSpan:
    """The span of one request, or nothing at all when tracing is off."""

    __slots__ = ("_span",)

    def __init__(
        self,
        headers: Sequence[tuple[bytes, bytes]] = (),
        attributes: dict[str, Any] | None = None,
    ) -> None:
        self._span: Any = None
        if TRACER is None or attributes is None:
            return
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in headers
            if k in (b"traceparent", b"tracestate")
        }
        parent = TraceContextTextMapPropagator().extract(carrier) if carrier else None
        self._span = TRACER.start_span(
            "llmgate.request", context=parent, kind=SpanKind.SERVER, attributes=attributes
        )

    @property
    def on(self) -> bool:
        return self._span is not None

    def event(self, name: str, **attributes: Any) -> None:
        if self._span is not None:
            self._span.add_event(name, attributes)

    def headers(self) -> dict[str, str] | None:
        """This span's context as W3C headers, for the worker (None when off)."""
        if self._span is None:
            return None
        from opentelemetry.trace import set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, set_span_in_context(self._span))
        return carrier

    def end(self, status: int) -> None:
        if self._span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        self._span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self._span.set_status(Status(StatusCode.ERROR))
        self._span.end()
        self._span = None


# What every request gets while tracing is off: no span, and nothing to do.
NO_SPAN = RequestSpan()
