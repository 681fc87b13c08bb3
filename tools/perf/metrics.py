"""Reading a service's Prometheus /metrics page: every sample by name, a sum over labels,
and the HTTP address of an edge from its WebSocket URL."""

from __future__ import annotations

import urllib.request


def scrape_metrics(
    address: str, timeout_s: float = 5.0
) -> dict[str, list[tuple[dict[str, str], float]]]:
    """GET http://address/metrics: sample name -> [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as reply:
        text = reply.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def metric(samples: dict, name: str, **labels: str) -> float:
    """Sum of `name` over the samples whose labels include `labels` (0 when absent)."""
    return sum(
        v for lbl, v in samples.get(name, []) if all(lbl.get(k) == x for k, x in labels.items())
    )


def http_address(url: str) -> str:
    """host:port of a WebSocket URL (ws://HOST:PORT/v1/realtime): the edge serves /metrics
    and /status on its WebSocket port."""
    return url.split("://", 1)[1].split("/", 1)[0]
