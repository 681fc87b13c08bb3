"""Edge configuration: a frozen dataclass read from OMNI_EDGE_* variables, flags on top."""

from __future__ import annotations

import hashlib
import os
import ssl
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any


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


KeyLimits = tuple[tuple[str, int], ...]
"""Per-key session limits: (key digest, max sessions) pairs."""


def parse_key_entry(entry: str, where: str) -> tuple[str, int | None]:
    """`KEY [max_sessions=N]` -> (digest, limit or None). Errors name `where`, never the key."""
    key, *options = entry.split()
    limit = None
    for option in options:
        name, sep, value = option.partition("=")
        if name != "max_sessions" or not sep:
            raise ValueError(f"{where}: expected 'KEY [max_sessions=N]'")
        try:
            limit = int(value)
        except ValueError:
            raise ValueError(f"{where}: max_sessions must be an integer") from None
        if not 0 <= limit <= 1_000_000:
            raise ValueError(f"{where}: max_sessions must be in [0, 1000000]")
    return hash_key(key), limit


def read_key_file(path: str) -> tuple[frozenset[str], KeyLimits]:
    """Digests and per-key session limits of a key file: one `KEY [max_sessions=N]` a
    line, '#' comments and blanks ignored. Raises ValueError or OSError."""
    keys = set()
    limits = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if line and not line.startswith("#"):
            digest, limit = parse_key_entry(line, f"API key file {path} line {number}")
            keys.add(digest)
            if limit is not None:
                limits[digest] = limit
    if not keys:
        raise ValueError(f"API key file {path} holds no key")
    return frozenset(keys), tuple(sorted(limits.items()))


def load_key_file(path: str) -> frozenset[str]:
    """Digests of the keys in a file (see read_key_file)."""
    return read_key_file(path)[0]


def tls_context(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """Server TLS context from PEM files, or None for plain TCP. Raises ValueError when
    only one is given, or a file is unreadable or not a valid certificate/key."""
    if cert is None and key is None:
        return None
    if not cert or not key:
        raise ValueError(
            "TLS needs both a certificate and a key: OMNI_EDGE_TLS_CERT and OMNI_EDGE_TLS_KEY "
            "(--tls-cert, --tls-key), or neither"
        )
    for what, path in (("certificate", cert), ("key", key)):
        try:
            Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"TLS {what} {path} cannot be read: {exc.strerror or exc}") from None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ValueError(
            f"TLS certificate {cert} / key {key} is not a valid PEM pair: {exc.reason or exc}"
        ) from None
    return context


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
    api_key_limits: KeyLimits = ()
    """Per-key session limits from the key file (`KEY max_sessions=N`), by digest."""
    max_sessions_per_key: int = 0
    """Open sessions one API key may hold at once, over every WebSocket endpoint and the
    gRPC RealtimeService (0 = unlimited; a key file entry overrides it for its key)."""
    max_frame_bytes: int = 16 * 1024 * 1024
    """Largest WebSocket message accepted; larger ones close the connection with 1009."""
    open_timeout_s: float = 10.0
    """A WebSocket handshake not finished by then is dropped."""
    ping_interval_s: float = 20.0
    """WebSocket keepalive ping interval."""
    ping_timeout_s: float = 20.0
    """A client that does not answer a ping within this is closed (also when the ping
    cannot even be written because the client stopped reading)."""
    inbound_queue_max: int = 16
    """Received WebSocket messages buffered per connection before reading pauses."""
    outbound_queue_max: int = 64
    """Events queued per connection for a client that reads slower than they come; one
    more closes the connection (slow_client, 1008)."""
    outbound_queue_bytes: int = 2 * 1024 * 1024
    """The same bound in bytes of JSON (one event always fits an empty queue)."""
    drain_grace_s: float = 5.0
    """On SIGTERM: time open sessions get to end with server_shutdown before the stop."""
    tls_cert: str | None = None
    """PEM certificate (chain) for wss:// and TLS on the gRPC port; needs tls_key."""
    tls_key: str | None = None
    """PEM private key of tls_cert."""
    fabric_tls_ca: str | None = None
    """PEM CA the scheduler's and workers' certificates are checked against; set = the
    edge dials them over TLS (edge/fabric.py), unset = plaintext."""
    fabric_tls_cert: str | None = None
    """PEM client certificate the edge presents to them (mutual TLS); needs fabric_tls_key."""
    fabric_tls_key: str | None = None
    """PEM private key of fabric_tls_cert."""
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
    default_ref_audio: str | None = None
    """WAV file served at GET /api/default_ref_audio (the workers' default voice; `omnifabric
    serve` passes the one its workers use). None: that endpoint answers 404."""
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
        limits: dict[str, int] = {}
        if os.environ.get("OMNI_API_KEYS"):
            entries = [k for k in os.environ["OMNI_API_KEYS"].split(",") if k.strip()]
            for i, entry in enumerate(entries, 1):
                digest, limit = parse_key_entry(entry, f"OMNI_API_KEYS entry {i}")
                keys = keys | {digest}
                if limit is not None:
                    limits[digest] = limit
        if os.environ.get("OMNI_API_KEYS_FILE"):
            file_keys, file_limits = read_key_file(os.environ["OMNI_API_KEYS_FILE"])
            keys = keys | file_keys
            limits.update(file_limits)
        return cls(
            host=os.environ.get("OMNI_EDGE_HOST", cls.host),
            port=_env_int("OMNI_EDGE_PORT", cls.port, 0, 65535),
            grpc_port=_env_int("OMNI_EDGE_GRPC_PORT", cls.grpc_port, -1, 65535),
            scheduler=os.environ.get("OMNI_EDGE_SCHEDULER", cls.scheduler),
            api_key_digests=keys,
            api_key_limits=tuple(sorted(limits.items())),
            max_sessions_per_key=_env_int(
                "OMNI_EDGE_MAX_SESSIONS_PER_KEY", cls.max_sessions_per_key, 0, 1_000_000
            ),
            max_frame_bytes=_env_int(
                "OMNI_EDGE_MAX_FRAME_BYTES", cls.max_frame_bytes, 1024, 1 << 30
            ),
            open_timeout_s=_env_float("OMNI_EDGE_OPEN_TIMEOUT_S", cls.open_timeout_s, 0.1, 600),
            ping_interval_s=_env_float("OMNI_EDGE_PING_INTERVAL_S", cls.ping_interval_s, 0.1, 3600),
            ping_timeout_s=_env_float("OMNI_EDGE_PING_TIMEOUT_S", cls.ping_timeout_s, 0.1, 3600),
            inbound_queue_max=_env_int(
                "OMNI_EDGE_INBOUND_QUEUE_MAX", cls.inbound_queue_max, 1, 1024
            ),
            outbound_queue_max=_env_int(
                "OMNI_EDGE_OUTBOUND_QUEUE_MAX", cls.outbound_queue_max, 1, 100_000
            ),
            outbound_queue_bytes=_env_int(
                "OMNI_EDGE_OUTBOUND_QUEUE_BYTES", cls.outbound_queue_bytes, 64 * 1024, 1 << 30
            ),
            drain_grace_s=_env_float("OMNI_EDGE_DRAIN_GRACE_S", cls.drain_grace_s, 0, 3600),
            tls_cert=os.environ.get("OMNI_EDGE_TLS_CERT") or None,
            tls_key=os.environ.get("OMNI_EDGE_TLS_KEY") or None,
            fabric_tls_ca=os.environ.get("OMNI_FABRIC_TLS_CA") or None,
            fabric_tls_cert=os.environ.get("OMNI_FABRIC_TLS_CERT") or None,
            fabric_tls_key=os.environ.get("OMNI_FABRIC_TLS_KEY") or None,
            unit_timeout_s=_env_float("OMNI_EDGE_UNIT_TIMEOUT_S", cls.unit_timeout_s, 0.5, 600),
            grpc_max_message_bytes=_env_int(
                "OMNI_EDGE_GRPC_MAX_MESSAGE_BYTES", cls.grpc_max_message_bytes, 1 << 16, 1 << 30
            ),
            allowed_origins=tuple(
                o.strip()
                for o in os.environ.get("OMNI_EDGE_ALLOWED_ORIGINS", "").split(",")
                if o.strip()
            ),
            record_dir=os.environ.get("OMNI_EDGE_RECORD_DIR") or None,
            default_ref_audio=os.environ.get("OMNI_EDGE_DEFAULT_REF_AUDIO") or None,
            record_max_age_days=_env_float(
                "OMNI_EDGE_RECORD_MAX_AGE_DAYS", cls.record_max_age_days, 0.001, 36500
            ),
            record_max_bytes=_env_int(
                "OMNI_EDGE_RECORD_MAX_BYTES", cls.record_max_bytes, 1 << 20, 1 << 50
            ),
        )

    def with_overrides(self, **changes: Any) -> EdgeConfig:
        """A copy with the given fields replaced (None values are ignored); the values are
        the CLI's parsed flags, each of its field's type."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def session_limit(self, digest: str) -> int:
        """Open sessions the key with this digest may hold (0 = unlimited)."""
        return dict(self.api_key_limits).get(digest, self.max_sessions_per_key)

    def tls(self) -> ssl.SSLContext | None:
        """The server TLS context, or None without TLS; ValueError for a bad setup."""
        return tls_context(self.tls_cert, self.tls_key)
