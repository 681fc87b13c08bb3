"""API keys and per-key session limits, shared by the WebSocket and gRPC surfaces.

Only SHA-256 digests of keys are held; logs name a key by the first 8 hex digits of its
digest at most.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import socket
from typing import Any

from omnifabric.edge.config import EdgeConfig, hash_key

log = logging.getLogger("omnifabric.edge.access")

#: Why an edge without keys refuses an operator request from beyond loopback (the 403).
LOOPBACK_ONLY = (
    "with no API keys configured, operator endpoints answer only clients on loopback "
    "(set API keys with an admin key to operate remotely)"
)
#: Why an edge with keys refuses an operator request (the 403).
ADMIN_ONLY = "this needs an admin key"


def key_digest(config: EdgeConfig, authorization: str) -> str | None:
    """The digest of a valid `Bearer KEY` header value; "" when keys are off; None when
    the key is missing or unknown (constant-time compare against every digest)."""
    if not config.api_key_digests:
        return ""
    scheme, _, key = authorization.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        return None
    digest = hash_key(key)
    # Compare against every digest so timing does not reveal which one matched.
    matched = False
    for allowed in config.api_key_digests:
        matched |= hmac.compare_digest(digest, allowed)
    return digest if matched else None


def is_loopback(address: str | None) -> bool:
    """Whether `address`, an IP literal as a socket names its peer, is this host's loopback:
    127.0.0.0/8, ::1, or 127.x mapped into IPv6 (::ffff:127.x). Anything else is not:
    other addresses, hostnames, "" and None."""
    if not address:
        return False
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def peer_host(peername: Any) -> str:
    """The address of a connection's peer from its transport's `peername` (a (host, port,
    ...) tuple on TCP); "" when there is none. The socket's own peer only: headers such as
    X-Forwarded-For are the client's word and never taken for it."""
    if isinstance(peername, tuple) and peername and isinstance(peername[0], str):
        return peername[0]
    return ""


def operator_refusal(config: EdgeConfig, authorization: str, peer: str) -> str | None:
    """Who may use the operator endpoints (switching apps, cancelling queue tickets, the wait
    estimate, deleting voices): None when this request may, else why not (the 403's
    message). With API keys configured: a valid key marked `admin` in the key file, from any
    address. Without keys: a client on loopback (`peer`, the connection's own address)."""
    if not config.api_key_digests:
        return None if is_loopback(peer) else LOOPBACK_ONLY
    digest = key_digest(config, authorization)
    if digest is not None and digest in config.admin_key_digests:
        return None
    return ADMIN_ONLY


def listens_beyond_loopback(host: str) -> bool:
    """Whether binding `host` listens on more than loopback: "" (every interface), a
    wildcard or any address it names that is not loopback (a name that does not resolve
    counts as beyond)."""
    if not host:
        return True
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError):
        return True
    return not found or not all(is_loopback(str(info[4][0])) for info in found)


def warn_if_open(config: EdgeConfig) -> bool:
    """At start, once per edge (the process that read the configuration, not each child of
    `--processes`): log a warning when it listens beyond loopback with no API keys. True
    when it warned."""
    if config.api_key_digests or not listens_beyond_loopback(config.host):
        return False
    log.warning(
        "the edge listens on %s, beyond loopback, with no API keys: its public endpoints "
        "(sessions, POST /api/chat, gRPC, the HTTP API) are open to anyone who reaches the "
        "port, and operator endpoints answer loopback clients only. Set OMNI_API_KEYS or "
        "--api-keys-file (a key marked admin operates remotely)",
        config.host or "every interface",
    )
    return True


#: Browsers cannot set Authorization on a WebSocket: they offer the key as a subprotocol
#: instead, `bearer.<key>` (ours) or `openai-insecure-api-key.<key>` (OpenAI's browser
#: clients), which the edge never selects (so never echoes).
SUBPROTOCOL_KEY_PREFIXES = ("bearer.", "openai-insecure-api-key.")


def subprotocol_key(offered: list[str]) -> str | None:
    """The API key in the first key subprotocol offered, or None."""
    for name in offered:
        for prefix in SUBPROTOCOL_KEY_PREFIXES:
            if name.lower().startswith(prefix):
                return name[len(prefix) :] or None
    return None


def key_label(digest: str) -> str:
    """How logs name a key: a short prefix of its digest, never the key."""
    return f"sha256:{digest[:8]}"


class KeySessions:
    """Open sessions per key digest in this edge process, against each key's limit (0 =
    unlimited). The scheduler holds the key to the same limit across every edge
    (worker_client.key_claim): this count answers 429 before the upgrade, that one after.

    A slot is taken before the upgrade (or at the RPC's start) and given back when the
    connection ends, whatever ends it.
    """

    def __init__(self, config: EdgeConfig) -> None:
        self._config = config
        self._open: dict[str, int] = {}

    def limit(self, digest: str) -> int:
        return self._config.session_limit(digest)

    def open(self, digest: str) -> int:
        """Sessions the key holds now."""
        return self._open.get(digest, 0)

    def take(self, digest: str) -> bool:
        """Count one more session for this key; False (nothing counted) at its limit."""
        limit = self.limit(digest)
        held = self._open.get(digest, 0)
        if limit and held >= limit:
            log.warning(
                "key %s holds %d sessions, its limit: new session refused", key_label(digest), held
            )
            return False
        self._open[digest] = held + 1
        return True

    def give_back(self, digest: str) -> None:
        """One session of this key ended."""
        held = self._open.get(digest, 0) - 1
        if held > 0:
            self._open[digest] = held
        else:
            self._open.pop(digest, None)
