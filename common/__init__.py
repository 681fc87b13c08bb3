"""What every service repeats, once: JSON logging, OpenTelemetry tracing and the fabric's gRPC
TLS. A leaf package: it imports nothing of the services; edge, worker and scheduler import it."""
