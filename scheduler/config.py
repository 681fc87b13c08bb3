"""Scheduler settings: a frozen dataclass, read from OMNI_SCHEDULER_* variables."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Environment variable for each field.
ENV_VARS: dict[str, str] = {
    "host": "OMNI_SCHEDULER_HOST",
    "port": "OMNI_SCHEDULER_PORT",
    "queue_max": "OMNI_SCHEDULER_QUEUE_MAX",
    "queue_update_interval_s": "OMNI_SCHEDULER_QUEUE_UPDATE_INTERVAL_S",
    "eta_alpha": "OMNI_SCHEDULER_ETA_ALPHA",
    "eta_initial_s": "OMNI_SCHEDULER_ETA_INITIAL_S",
    "release_timeout_s": "OMNI_SCHEDULER_RELEASE_TIMEOUT_S",
    "worker_timeout_s": "OMNI_SCHEDULER_WORKER_TIMEOUT_S",
    "metrics_port": "OMNI_SCHEDULER_METRICS_PORT",
    "drain_grace_s": "OMNI_SCHEDULER_DRAIN_GRACE_S",
    "max_message_bytes": "OMNI_SCHEDULER_MAX_MESSAGE_BYTES",
    "tls_ca": "OMNI_FABRIC_TLS_CA",
    "tls_cert": "OMNI_FABRIC_TLS_CERT",
    "tls_key": "OMNI_FABRIC_TLS_KEY",
}

# Inclusive bounds of each numeric field.
_RANGES: dict[str, tuple[float, float]] = {
    "port": (0, 65535),
    "queue_max": (1, 1_000_000),
    "queue_update_interval_s": (0.01, 3600.0),
    "eta_alpha": (0.001, 1.0),
    "eta_initial_s": (0.001, 86_400.0),
    "release_timeout_s": (0.01, 3600.0),
    "worker_timeout_s": (0.1, 3600.0),
    "metrics_port": (-1, 65535),
    "drain_grace_s": (0.0, 3600.0),
    "max_message_bytes": (1024, 1 << 30),
}


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler listens, queues and estimates waits."""

    host: str = "127.0.0.1"
    """Address to bind the gRPC server to."""

    port: int = 50051
    """gRPC port; 0 binds any free port (the bound one is printed when ready)."""

    queue_max: int = 100
    """Most requests that may wait in the queue; one more is rejected as queue_full."""

    queue_update_interval_s: float = 3.0
    """Longest gap, in seconds, between two position updates to a waiting client."""

    eta_alpha: float = 0.2
    """Weight of a newly observed session length in the moving average (0-1]."""

    eta_initial_s: float = 60.0
    """Mean session length, in seconds, assumed for a mode before any was observed."""

    release_timeout_s: float = 10.0
    """Seconds a worker gets to answer a revocation before its slot is freed anyway."""

    worker_timeout_s: float = 3.0
    """A worker silent this long on its Register stream (workers report every second) is
    hung: its registration ends and its leases are lost (RELIABILITY.md F2)."""

    metrics_port: int = 9150
    """Port of the Prometheus /metrics HTTP server (same host); 0 = any free port, -1 = off."""

    drain_grace_s: float = 5.0
    """On SIGTERM: the longest wait, in seconds, for open RPCs to end before the server
    stops (queued requests are refused and lease streams ended at once; sessions go on)."""

    max_message_bytes: int = 8 * 1024 * 1024
    """Largest gRPC message either way; a larger one fails with RESOURCE_EXHAUSTED."""

    tls_ca: str | None = None
    """PEM CA file: with tls_cert/tls_key set, clients must present a certificate it signed."""

    tls_cert: str | None = None
    """PEM certificate of this server; with tls_key, the server speaks TLS only."""

    tls_key: str | None = None
    """PEM private key of tls_cert."""

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must not be empty")
        for name in _RANGES:
            check_range(name, getattr(self, name), name)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(
                f"{ENV_VARS['tls_cert']} and {ENV_VARS['tls_key']} "
                "(--fabric-tls-cert, --fabric-tls-key) must be set together"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SchedulerConfig:
        """Defaults overridden by the OMNI_SCHEDULER_* variables that are set.

        Raises ValueError naming the variable when one is malformed or out of range.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, var in ENV_VARS.items():
            raw = env.get(var)
            if raw is not None and raw.strip() != "":
                values[name] = parse_value(name, raw, var)
        return cls(**values)


def parse_value(field: str, raw: str, source: str) -> Any:
    """Convert `raw` to `field`'s type and check its range; errors name `source`."""
    kind = {f.name: f.type for f in dataclasses.fields(SchedulerConfig)}[field]
    if kind.startswith("str"):
        if not raw:
            raise ValueError(f"{source} must not be empty")
        return raw
    try:
        value: int | float = int(raw) if kind == "int" else float(raw)
    except ValueError:
        raise ValueError(
            f"{source} must be a{'n integer' if kind == 'int' else ' number'}, got {raw!r}"
        ) from None
    check_range(field, value, source)
    return value


def check_range(field: str, value: float, source: str) -> None:
    """Raise ValueError naming `source` unless `value` lies within `field`'s bounds."""
    low, high = _RANGES[field]
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"{source} must be between {low} and {high}, got {value!r}")
