"""OpenTelemetry tracing for every service: the SDK with service.name (omnifabric-SERVICE)
and an instance id, exporting over OTLP when the standard OTEL_EXPORTER_OTLP_* variables are
set; spans are no-ops otherwise.

W3C traceparent crosses every gRPC hop in metadata: inject() for outgoing calls, extract()
for incoming ones.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from opentelemetry import propagate, trace
from opentelemetry.context import Context

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger("omnifabric.common.telemetry")


def tracer(service: str) -> trace.Tracer:
    """The tracer of `service` (edge, worker, scheduler): instrumentation omnifabric.SERVICE.
    It follows the provider setup() installs, also when taken before."""
    return trace.get_tracer(f"omnifabric.{service}")


def setup(service: str, instance_id: str) -> TracerProvider | None:
    """Install a TracerProvider exporting over OTLP/gRPC when OTEL_EXPORTER_OTLP_ENDPOINT
    (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set; returns it (call shutdown() to flush),
    or None when tracing is off."""
    if not (
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        return None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = f"omnifabric-{service}"
    resource = Resource.create({"service.name": name, "service.instance.id": instance_id})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    log.info("tracing: exporting spans over OTLP as %s/%s", name, instance_id)
    return provider


def inject(context: Context | None = None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying the trace context (traceparent, tracestate)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return tuple(carrier.items())


def extract(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """The trace context an incoming call carried in its metadata."""
    return propagate.extract({k: v for k, v in (metadata or ()) if isinstance(v, str)})
