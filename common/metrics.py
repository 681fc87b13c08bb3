"""What the services' Prometheus instruments share."""

from __future__ import annotations

from typing import Any


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
