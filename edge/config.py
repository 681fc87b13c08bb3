"""Edge configuration: a frozen dataclass read from OMNI_EDGE_* variables, flags on top."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field, replace
from pathlib import Path


def _env_int(name: str, default: int, lo: int, hi: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def _env_float(name: str, default: float, lo: float, hi: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def hash_key(key: str) -> str:
    """SHA-256 hex digest of an API key: only digests are kept in memory."""
    return hashlib.sha256(key.encode()).hexdigest()


def load_key_file(path: str) -> frozenset[str]:
    """Digests of the keys in a file: one key per line, '#' comments and blanks ignored."""
    keys = set()
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.add(hash_key(line))
    if not keys:
        raise ValueError(f"API key file {path} holds no key")
    return frozenset(keys)


@dataclass(frozen=True)
class EdgeConfig:
    """Settings of one edge process."""

    host: str = "127.0.0.1"
    """Address the WebSocket/HTTP and gRPC servers bind."""
    port: int = 8006
    """WebSocket + HTTP port (/v1/realtime, /healthz); 0 picks a free port."""
    grpc_port: int = 8007
    """RealtimeService gRPC port for internal clients; 0 picks a free port, -1 disables."""
    scheduler: str = "127.0.0.1:50051"
    """host:port of the scheduler."""
    api_key_digests: frozenset[str] = field(default_factory=frozenset)
    """SHA-256 digests of accepted API keys; empty = no authentication."""
    max_frame_bytes: int = 16 * 1024 * 1024
    """Largest WebSocket message accepted; larger ones close the connection with 1009."""
    open_timeout_s: float = 10.0
    """A WebSocket handshake not finished by then is dropped."""
    ping_interval_s: float = 20.0
    """WebSocket keepalive ping interval."""
    ping_timeout_s: float = 20.0
    """A client that does not answer a ping within this is closed."""
    worker_start_timeout_s: float = 30.0
    """Time allowed for a worker to prepare a session (system prompt, voices)."""
    allowed_origins: tuple[str, ...] = ()
    """Browser Origins allowed to open WebSockets (empty = any). Clients sending no Origin
    header (SDKs, scripts) are always allowed; a listed-out Origin gets HTTP 403."""
    unit_timeout_s: float = 3.0
    """A unit with no result (nor a counted drop) after this long means the worker is hung:
    the session closes with error (RELIABILITY.md F2 asks for detection within 5 s)."""
    close_timeout_s: float = 5.0
    """Time allowed for a worker to confirm a session's end before the edge gives up."""
    ws_close_timeout_s: float = 2.0
    """Time a client gets to answer the WebSocket close handshake."""
    grpc_max_message_bytes: int = 16 * 1024 * 1024
    """Largest gRPC message to and from the services."""
    default_mode: str = "video"
    """Mode of /v1/realtime when the URL names none (the spec's default)."""
    record_dir: str | None = None
    """Record every /v1/realtime audio/video session under this folder (edge/recording.py)."""
    record_max_age_days: float = 7.0
    """Recordings older than this are deleted (at start, then hourly)."""
    record_max_bytes: int = 10 * 1024**3
    """Then the oldest recordings are deleted until the rest fit in this many bytes."""

    @classmethod
    def from_env(cls) -> EdgeConfig:
        """Defaults overridden by OMNI_EDGE_* variables (range-checked)."""
        keys: frozenset[str] = frozenset()
        if os.environ.get("OMNI_API_KEYS"):
            keys = frozenset(
                hash_key(k.strip()) for k in os.environ["OMNI_API_KEYS"].split(",") if k.strip()
            )
        if os.environ.get("OMNI_API_KEYS_FILE"):
            keys = keys | load_key_file(os.environ["OMNI_API_KEYS_FILE"])
        return cls(
            host=os.environ.get("OMNI_EDGE_HOST", cls.host),
            port=_env_int("OMNI_EDGE_PORT", cls.port, 0, 65535),
            grpc_port=_env_int("OMNI_EDGE_GRPC_PORT", cls.grpc_port, -1, 65535),
            scheduler=os.environ.get("OMNI_EDGE_SCHEDULER", cls.scheduler),
            api_key_digests=keys,
            max_frame_bytes=_env_int(
                "OMNI_EDGE_MAX_FRAME_BYTES", cls.max_frame_bytes, 1024, 1 << 30
            ),
            open_timeout_s=_env_float("OMNI_EDGE_OPEN_TIMEOUT_S", cls.open_timeout_s, 0.1, 600),
            ping_interval_s=_env_float("OMNI_EDGE_PING_INTERVAL_S", cls.ping_interval_s, 0.1, 3600),
            ping_timeout_s=_env_float("OMNI_EDGE_PING_TIMEOUT_S", cls.ping_timeout_s, 0.1, 3600),
            unit_timeout_s=_env_float("OMNI_EDGE_UNIT_TIMEOUT_S", cls.unit_timeout_s, 0.5, 600),
            allowed_origins=tuple(
                o.strip()
                for o in os.environ.get("OMNI_EDGE_ALLOWED_ORIGINS", "").split(",")
                if o.strip()
            ),
            record_dir=os.environ.get("OMNI_EDGE_RECORD_DIR") or None,
            record_max_age_days=_env_float(
                "OMNI_EDGE_RECORD_MAX_AGE_DAYS", cls.record_max_age_days, 0.001, 36500
            ),
            record_max_bytes=_env_int(
                "OMNI_EDGE_RECORD_MAX_BYTES", cls.record_max_bytes, 1 << 20, 1 << 50
            ),
        )

    def with_overrides(self, **changes: object) -> EdgeConfig:
        """A copy with the given fields replaced (None values are ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})
