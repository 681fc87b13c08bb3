"""What the services' Prometheus instruments share."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

from omnifabric.common import listen


class LabelledChildren:
    """`metric.labels(*values)`, looked up once per metric and values: labels() validates
    its values and takes a lock on every call (~33 us on a cold path), a dict lookup does
    not. For the instruments every unit touches."""

    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def __call__(self, metric: Any, *values: str) -> Any:
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child


def serve_http(registry: CollectorRegistry, host: str, port: int) -> tuple[Any, int]:
    """Serve ``registry`` over HTTP on host:port (0: any free port) from a daemon thread.

    Every GET path answers with the metrics (/metrics; /healthz too, as a liveness probe).
    Returns the server and its bound port. Raises OSError naming the address when it cannot
    listen there (a service's entry point prints it as one line)."""
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise listen.cannot_listen(host, port, exc, "serve metrics on") from None
    return server, int(server.server_address[1])
