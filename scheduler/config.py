"""Scheduler settings: a frozen dataclass read from OMNI_SCHEDULER_* variables and flags
(omnifabric.common.config)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from omnifabric.common import config as settings
from omnifabric.common import realtime
from omnifabric.common.config import ConfigError, setting
from omnifabric.common.tls import FabricTls
from omnifabric.scheduler import election


@dataclass(frozen=True)
class SchedulerConfig(FabricTls):
    """How the scheduler listens, queues and estimates waits; the fabric's TLS files are
    common.tls.FabricTls's settings."""

    host: str = setting(
        "127.0.0.1", env="OMNI_SCHEDULER_HOST", flag="--host", help="address to bind"
    )
    """Address to bind the gRPC server to."""

    port: int = setting(
        50051,
        env="OMNI_SCHEDULER_PORT",
        flag="--port",
        range=(0, 65535),
        help="gRPC port, 0 = any free",
    )
    """gRPC port; 0 binds any free port (the bound one is printed when ready)."""

    queue_max: int = setting(
        100,
        env="OMNI_SCHEDULER_QUEUE_MAX",
        flag="--queue-max",
        range=(1, 1_000_000),
        help="most sessions waiting in the queue; one more is refused with queue_full",
    )
    """Most requests that may wait in the queue; one more is rejected as queue_full."""

    queue_update_interval_s: float = setting(
        3.0,
        env="OMNI_SCHEDULER_QUEUE_UPDATE_INTERVAL_S",
        flag="--queue-update-interval",
        range=(0.01, 3600.0),
        help="longest gap between position updates, s",
    )
    """Longest gap, in seconds, between two position updates to a waiting client."""

    realtime_margin: float = setting(
        realtime.MARGIN,
        env="OMNI_SCHEDULER_REALTIME_MARGIN",
        flag="--realtime-margin",
        range=(0.0, 64.0),
        help="share of a worker's engine time its sessions may take (0: slots alone)",
    )
    """A worker gets one more session only while its sessions and the new one cost at most
    this share of its engine threads' time, by the costs it reports (common.realtime), and
    it has had no late unit lately; 0 leases by free slots alone."""

    eta_alpha: float = setting(
        0.2,
        env="OMNI_SCHEDULER_ETA_ALPHA",
        range=(0.001, 1.0),
        help="ETA: weight of a newly observed session length in its mode's moving average",
    )
    """Weight of a newly observed session length in the moving average (0-1]."""

    eta_initial_s: float = setting(
        60.0,
        env="OMNI_SCHEDULER_ETA_INITIAL_S",
        range=(0.001, 86_400.0),
        help="ETA: session length assumed for a mode before one was observed, s",
    )
    """Mean session length, in seconds, assumed for a mode before any was observed."""

    release_timeout_s: float = setting(
        10.0,
        env="OMNI_SCHEDULER_RELEASE_TIMEOUT_S",
        range=(0.01, 3600.0),
        help="a slot is freed anyway when its worker never confirms the release, s",
    )
    """Seconds a worker gets to answer a revocation before its slot is freed anyway."""

    worker_timeout_s: float = setting(
        3.0,
        env="OMNI_SCHEDULER_WORKER_TIMEOUT_S",
        range=(0.1, 3600.0),
        help="a worker silent this long (workers report every 1 s) is hung: dropped, its "
        "leases end, s",
    )
    """A worker silent this long on its Register stream (workers report every second) is
    hung: its registration ends and its leases are lost (RELIABILITY.md F2)."""

    metrics_port: int = setting(
        9150,
        env="OMNI_SCHEDULER_METRICS_PORT",
        flag="--metrics-port",
        range=(-1, 65535),
        help="Prometheus /metrics port, 0 = any free, -1 = off",
    )
    """Port of the Prometheus /metrics HTTP server (same host); 0 = any free port, -1 = off."""

    drain_grace_s: float = setting(
        5.0,
        env="OMNI_SCHEDULER_DRAIN_GRACE_S",
        flag="--grace",
        range=(0.0, 3600.0),
        help="on SIGTERM: the longest wait for open RPCs before the server stops, s",
    )
    """On SIGTERM: the longest wait, in seconds, for open RPCs to end before the server
    stops (queued requests are refused and lease streams ended at once; sessions go on)."""

    status_entries: int = setting(
        1000,
        env="OMNI_SCHEDULER_STATUS_ENTRIES",
        flag="--status-entries",
        range=(1, 1_000_000),
        help="GetStatus: queue entries, running leases and workers' lease ids listed at "
        "most, each, unless the request asks another bound",
    )
    """GetStatus lists at most this many waiting requests, running leases and workers' lease
    ids each (the first in line, the longest-running, whole workers' lists in worker order),
    unless the request names its own bound: a fleet of 57,600 sessions made a 6.6 MB reply
    that took the scheduler ~1 s, and past ~70,000 the reply outgrows --max-message-bytes.
    The counts (workers' leases by mode included) always cover the whole fleet."""

    max_message_bytes: int = setting(
        8 * 1024 * 1024,
        env="OMNI_SCHEDULER_MAX_MESSAGE_BYTES",
        flag="--max-message-bytes",
        range=(1024, 1 << 30),
        help="largest gRPC message; larger: RESOURCE_EXHAUSTED",
    )
    """Largest gRPC message either way; a larger one fails with RESOURCE_EXHAUSTED."""

    ha: str | None = setting(
        None,
        env="OMNI_SCHEDULER_HA",
        flag="--ha",
        help="active/standby: the election store, redis://HOST:PORT/DB or "
        "redis+sentinel://HOST:PORT[,HOST:PORT]/SERVICE/DB (needs the `ha` extra)",
    )
    """Active/standby schedulers: the Redis (or Sentinel) address of the leader key. Unset:
    this scheduler leads alone, as without an election (redis is never imported)."""

    ha_ttl_s: float = setting(
        election.DEFAULT_TTL_S,
        env="OMNI_SCHEDULER_HA_TTL_S",
        flag="--ha-ttl",
        range=(0.3, 60.0),
        help="leader key time to live, s: a crashed leader is replaced within it",
    )
    """Time to live of the leader key, seconds (renewed every third of it). A crashed
    leader's successor takes over within it; a leader cut off from the store stops granting
    when it runs out."""

    def __post_init__(self) -> None:
        settings.check(self)
        if self.ha is not None:
            try:
                election.parse_store_url(self.ha)
            except election.StoreUrlError as exc:
                raise ConfigError("OMNI_SCHEDULER_HA", str(exc)) from None
        self.check_fabric_tls()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SchedulerConfig:
        """Defaults overridden by the OMNI_SCHEDULER_* variables that are set.

        Raises ConfigError (a ValueError) naming the variable when one is malformed or out
        of range.
        """
        return settings.load(cls, environ)
