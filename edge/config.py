"""Edge configuration: a frozen dataclass read from OMNI_EDGE_* variables and flags
(omnifabric.common.config); API keys from OMNI_API_KEYS / a key file."""

from __future__ import annotations

import hashlib
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from omnifabric.common import config as settings
from omnifabric.common import schedulers
from omnifabric.common.config import ConfigError, setting
from omnifabric.common.tls import FabricTls


def hash_key(key: str) -> str:
    """SHA-256 hex digest of an API key: only digests are kept in memory."""
    return hashlib.sha256(key.encode()).hexdigest()


KeyLimits = tuple[tuple[str, int], ...]
"""Per-key session limits: (key digest, max sessions) pairs."""


def parse_key_entry(entry: str, where: str) -> tuple[str, int | None, bool]:
    """`KEY [max_sessions=N] [admin]` -> (digest, limit or None, admin). Errors name
    `where`, never the key."""
    key, *options = entry.split()
    limit = None
    admin = False
    for option in options:
        if option == "admin":
            admin = True
            continue
        name, sep, value = option.partition("=")
        if name != "max_sessions" or not sep:
            raise ValueError(f"{where}: expected 'KEY [max_sessions=N] [admin]'")
        try:
            limit = int(value)
        except ValueError:
            raise ValueError(f"{where}: max_sessions must be an integer") from None
        if not 0 <= limit <= 1_000_000:
            raise ValueError(f"{where}: max_sessions must be in [0, 1000000]")
    return hash_key(key), limit, admin


def read_key_file(path: str) -> tuple[frozenset[str], KeyLimits, frozenset[str]]:
    """Digests, per-key session limits and admin digests of a key file: one
    `KEY [max_sessions=N] [admin]` a line, '#' comments and blanks ignored. Raises
    ValueError or OSError."""
    keys = set()
    limits = {}
    admins = set()
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if line and not line.startswith("#"):
            digest, limit, admin = parse_key_entry(line, f"API key file {path} line {number}")
            keys.add(digest)
            if limit is not None:
                limits[digest] = limit
            if admin:
                admins.add(digest)
    if not keys:
        raise ValueError(f"API key file {path} holds no key")
    return frozenset(keys), tuple(sorted(limits.items())), frozenset(admins)


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
class EdgeConfig(FabricTls):
    """Settings of one edge process."""

    host: str = setting("127.0.0.1", env="OMNI_EDGE_HOST", flag="--host", help="bind address")
    """Address the WebSocket/HTTP and gRPC servers bind."""
    port: int = setting(
        8006,
        env="OMNI_EDGE_PORT",
        flag="--port",
        range=(0, 65535),
        help="WebSocket/HTTP port, 0 = any",
    )
    """WebSocket + HTTP port (/v1/realtime, /healthz); 0 picks a free port."""
    grpc_port: int = setting(
        8007,
        env="OMNI_EDGE_GRPC_PORT",
        flag="--grpc-port",
        range=(-1, 65535),
        help="RealtimeService port, 0 = any, -1 = off",
    )
    """RealtimeService gRPC port for internal clients; 0 picks a free port, -1 disables."""
    processes: int = setting(
        1,
        env="OMNI_EDGE_PROCESSES",
        flag="--processes",
        range=(1, 256),
        help="edge processes sharing the ports (SO_REUSEPORT), one per core",
    )
    """Edge processes on this host: N > 1 starts N children that listen on the same
    WebSocket and gRPC ports (SO_REUSEPORT: the kernel spreads new connections over them)
    and stops them together on SIGTERM, each draining its own sessions."""
    reuse_port: bool = setting(
        False,
        env="OMNI_EDGE_REUSE_PORT",
        flag="--reuse-port",
        help="listen with SO_REUSEPORT (set by --processes for its children; without it a taken "
        "WebSocket or gRPC port fails the start)",
    )
    """Bind both ports with SO_REUSEPORT so that several edge processes share them. Off, a
    second edge on a taken port fails to start (the WebSocket and the gRPC port alike)."""
    process_index: int = setting(
        0,
        env="OMNI_EDGE_PROCESS_INDEX",
        range=(0, 256),
        help="set by --processes for its children: which one this is, 1..N (0: a lone edge)",
    )
    """Set by --processes for its children: which one this is, 1..N (0: a lone edge). Shown
    in /status and as /metrics' omni_edge_process{index, pid}."""
    scheduler: str = setting(
        "127.0.0.1:50051",
        env="OMNI_EDGE_SCHEDULER",
        flag="--scheduler",
        help="scheduler host:port; active/standby schedulers: several, comma-separated",
    )
    """host:port of the scheduler."""
    api_key_digests: frozenset[str] = field(default_factory=frozenset)
    """SHA-256 digests of accepted API keys; empty = no authentication."""
    api_key_limits: KeyLimits = ()
    admin_key_digests: frozenset[str] = field(default_factory=frozenset)
    """Keys marked `admin` in the key file: the operator endpoints (edge.access.
    operator_refusal) take only these when keys are configured."""
    """Per-key session limits from the key file (`KEY max_sessions=N`), by digest."""
    max_sessions_per_key: int = setting(
        0,
        env="OMNI_EDGE_MAX_SESSIONS_PER_KEY",
        flag="--max-sessions-per-key",
        range=(0, 1_000_000),
        help="open sessions one API key may hold on every endpoint of every edge together, "
        "0 = unlimited (a key file line may set its own: KEY max_sessions=N)",
    )
    """Open sessions one API key may hold at once, over every WebSocket endpoint and the
    gRPC RealtimeService (0 = unlimited; a key file entry overrides it for its key)."""
    max_frame_bytes: int = setting(
        16 * 1024 * 1024,
        env="OMNI_EDGE_MAX_FRAME_BYTES",
        flag="--max-frame-bytes",
        range=(1024, 1 << 30),
        help="largest WebSocket message; larger: close 1009",
    )
    """Largest WebSocket message accepted; larger ones close the connection with 1009."""
    open_timeout_s: float = setting(
        10.0,
        env="OMNI_EDGE_OPEN_TIMEOUT_S",
        flag="--open-timeout",
        range=(0.1, 600),
        help="the opening handshake (TCP, TLS, upgrade or POST head) must finish within this, "
        "else the socket is dropped, s",
    )
    """A WebSocket handshake not finished by then is dropped."""
    ping_interval_s: float = setting(
        20.0,
        env="OMNI_EDGE_PING_INTERVAL_S",
        flag="--ping-interval",
        range=(0.1, 3600),
        help="keepalive ping interval, s",
    )
    """WebSocket keepalive ping interval."""
    ping_timeout_s: float = setting(
        20.0,
        env="OMNI_EDGE_PING_TIMEOUT_S",
        flag="--ping-timeout",
        range=(0.1, 3600),
        help="keepalive: no pong within this (writing the ping counts) closes 1011 and drops "
        "the socket, s",
    )
    """A client that does not answer a ping within this is closed (also when the ping
    cannot even be written because the client stopped reading)."""
    inbound_queue_max: int = setting(
        16,
        env="OMNI_EDGE_INBOUND_QUEUE_MAX",
        range=(1, 1024),
        help="received messages buffered per connection before reading pauses (TCP "
        "back-pressure on the client)",
    )
    """Received WebSocket messages buffered per connection before reading pauses."""
    outbound_queue_max: int = setting(
        64,
        env="OMNI_EDGE_OUTBOUND_QUEUE_MAX",
        range=(1, 100_000),
        help="events queued for a client that reads slower than they come; beyond: "
        "slow_client, close 1008",
    )
    """Events queued per connection for a client that reads slower than they come; one
    more closes the connection (slow_client, 1008)."""
    outbound_queue_bytes: int = setting(
        2 * 1024 * 1024,
        env="OMNI_EDGE_OUTBOUND_QUEUE_BYTES",
        range=(64 * 1024, 1 << 30),
        help="the same bound in bytes of JSON (one event always fits)",
    )
    """The same bound in bytes of JSON (one event always fits an empty queue)."""
    resume_window_s: float = setting(
        30.0,
        env="OMNI_EDGE_RESUME_WINDOW_S",
        flag="--resume-window",
        range=(0, 600),
        help="how long a dropped Realtime session waits for its client to resume it, s "
        "(0: sessions end with their connection)",
    )
    """A Realtime duplex session whose connection drops (no close frame) or whose edge is
    lost keeps its worker slot and context this long for a resume on any edge."""
    drain_grace_s: float = setting(
        5.0,
        env="OMNI_EDGE_DRAIN_GRACE_S",
        flag="--grace",
        range=(0, 3600),
        help="on SIGTERM: time open sessions get to end with server_shutdown, s",
    )
    """On SIGTERM: time open sessions get to end with server_shutdown before the stop."""
    tls_cert: str | None = setting(
        None,
        env="OMNI_EDGE_TLS_CERT",
        flag="--tls-cert",
        help="PEM certificate: wss:// and https:// on the WebSocket port, TLS on the gRPC "
        "port (with --tls-key: both or neither)",
    )
    """PEM certificate (chain) for wss:// and TLS on the gRPC port; needs tls_key."""
    tls_key: str | None = setting(
        None, env="OMNI_EDGE_TLS_KEY", flag="--tls-key", help="PEM private key of --tls-cert"
    )
    """PEM private key of tls_cert."""
    worker_start_timeout_s: float = 30.0
    """Time allowed for a worker to prepare a session (system prompt, voices)."""
    ws_compression: str = setting(
        "off",
        env="OMNI_EDGE_WS_COMPRESSION",
        flag="--ws-compression",
        choices=("off", "deflate"),
        help="off: decline a client's permessage-deflate offer; deflate: accept it",
    )
    """off: WebSocket frames go uncompressed whatever the client offers (audio barely
    compresses and deflate costs 2-4 ms per 85 KB frame on each side); deflate: accept a
    client's permessage-deflate offer (for links where bytes cost more than CPU)."""
    allowed_origins: tuple[str, ...] = setting(
        (),
        env="OMNI_EDGE_ALLOWED_ORIGINS",
        flag="--allowed-origin",
        repeat=True,
        help="browser Origin allowed to connect (repeatable; default: any); others get HTTP "
        "403, clients sending no Origin (SDKs, scripts) always connect",
    )
    """Browser Origins allowed to open WebSockets (empty = any). Clients sending no Origin
    header (SDKs, scripts) are always allowed; a listed-out Origin gets HTTP 403."""
    unit_timeout_s: float = setting(
        6.0,
        env="OMNI_EDGE_UNIT_TIMEOUT_S",
        range=(0.5, 600),
        help="a unit unanswered this long (and not reported dropped) closes its session with "
        "error (hung worker); at least the worker's own unit timeout + 1 s, s",
    )
    """A unit with no result (nor a counted drop) after this long means the worker is hung:
    the session closes with error. It is the last of three watches and must exceed the
    worker's own engine timeout (OMNI_WORKER_UNIT_TIMEOUT_S, 5 s): a slow engine call is
    the worker's to judge (inference_error). The worker states its timeout when a session
    starts, and that session's watch waits at least that plus 1 s whatever is set here
    (edge/session.py WORKER_TIMEOUT_MARGIN_S). A hung worker process is dropped by the
    scheduler within 3-4 s (its leases end, which closes the session: RELIABILITY.md F2,
    within 5 s). At 3 s the edge closed sessions of a CPU engine whose turn-taking unit
    took 3 s on a loaded host while its worker was healthy."""
    close_timeout_s: float = 5.0
    """Time allowed for a worker to confirm a session's end before the edge gives up."""
    ws_close_timeout_s: float = 2.0
    """Time a client gets to answer the WebSocket close handshake."""
    grpc_max_message_bytes: int = setting(
        16 * 1024 * 1024,
        env="OMNI_EDGE_GRPC_MAX_MESSAGE_BYTES",
        range=(1 << 16, 1 << 30),
        help="largest gRPC message to and from the services and on the RealtimeService port",
    )
    """Largest gRPC message to and from the services."""
    default_mode: str = "video"
    """Mode of /v1/realtime when the URL names none (the spec's default)."""
    default_ref_audio: str | None = setting(
        None,
        env="OMNI_EDGE_DEFAULT_REF_AUDIO",
        flag="--default-ref-audio",
        help="WAV served at GET /api/default_ref_audio (the default voice)",
    )
    """WAV file served at GET /api/default_ref_audio (the workers' default voice; `omnifabric
    serve` passes the one its workers use). None: that endpoint answers 404."""
    presets_dir: str | None = setting(
        None,
        env="OMNI_EDGE_PRESETS_DIR",
        flag="--presets-dir",
        help="folder of system-prompt presets, MODE/ID.yaml (default: the packaged ones)",
    )
    """Served at GET /api/presets (edge/presets.py); None = the presets omnifabric ships."""
    voices_dir: str | None = setting(
        None,
        env="OMNI_EDGE_VOICES_DIR",
        flag="--voices-dir",
        help="folder of registered reference voices (default: $OMNI_CACHE_DIR/ref_audio)",
    )
    """/api/assets/ref_audio's store (edge/voices.py); None = $OMNI_CACHE_DIR/ref_audio."""
    playback_delay_ms: int = setting(
        200,
        env="OMNI_EDGE_PLAYBACK_DELAY_MS",
        range=(0, 2000),
        help="GET /api/frontend_defaults: how long pages buffer the first reply audio, ms",
    )
    """GET /api/frontend_defaults: how long pages buffer the first reply audio before
    playing it (absorbs network and inference jitter)."""
    record_dir: str | None = setting(
        None,
        env="OMNI_EDGE_RECORD_DIR",
        flag="--record-dir",
        help="record every audio/video session under this folder (user audio!)",
    )
    """Record every /v1/realtime audio/video session under this folder (edge/recording.py)."""
    record_max_age_days: float = setting(
        7.0,
        env="OMNI_EDGE_RECORD_MAX_AGE_DAYS",
        range=(0.001, 36500),
        help="recordings older than this are deleted (at start, then hourly), days",
    )
    """Recordings older than this are deleted (at start, then hourly)."""
    record_max_bytes: int = setting(
        10 * 1024**3,
        env="OMNI_EDGE_RECORD_MAX_BYTES",
        range=(1 << 20, 1 << 50),
        help="then the oldest recordings are deleted until the rest fit in this",
    )
    """Then the oldest recordings are deleted until the rest fit in this many bytes."""

    def __post_init__(self) -> None:
        settings.check(self)
        try:
            schedulers.addresses(self.scheduler)
        except ValueError as exc:
            raise ConfigError("OMNI_EDGE_SCHEDULER", str(exc)) from None
        self.check_fabric_tls()

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, flags: Mapping[str, Any] | None = None
    ) -> EdgeConfig:
        """Defaults, the OMNI_EDGE_* variables (range-checked, errors naming the variable), then
        `flags` (field -> value, None = not given). API keys come from OMNI_API_KEYS
        (comma-separated entries) and the file OMNI_API_KEYS_FILE names."""
        env = os.environ if environ is None else environ
        keys: frozenset[str] = frozenset()
        limits: dict[str, int] = {}
        admins: frozenset[str] = frozenset()
        if env.get("OMNI_API_KEYS"):
            entries = [k for k in env["OMNI_API_KEYS"].split(",") if k.strip()]
            for i, entry in enumerate(entries, 1):
                digest, limit, admin = parse_key_entry(entry, f"OMNI_API_KEYS entry {i}")
                keys = keys | {digest}
                if limit is not None:
                    limits[digest] = limit
                if admin:
                    admins = admins | {digest}
        if env.get("OMNI_API_KEYS_FILE"):
            file_keys, file_limits, file_admins = read_key_file(env["OMNI_API_KEYS_FILE"])
            keys = keys | file_keys
            limits.update(file_limits)
            admins = admins | file_admins
        return settings.load(
            cls,
            env,
            flags,
            api_key_digests=keys,
            api_key_limits=tuple(sorted(limits.items())),
            admin_key_digests=admins,
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
