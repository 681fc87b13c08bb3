"""API keys and per-key session limits, shared by the WebSocket and gRPC surfaces.

Only SHA-256 digests of keys are held; logs name a key by the first 8 hex digits of its
digest at most.
"""

from __future__ import annotations

import hmac
import logging

from omnifabric.edge.config import EdgeConfig, hash_key

log = logging.getLogger("omnifabric.edge.access")


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


def is_admin(config: EdgeConfig, authorization: str) -> bool:
    """Whether the request may use the operator endpoints: any request when keys are off,
    else a valid key marked `admin` in the key file."""
    digest = key_digest(config, authorization)
    return digest == "" or (digest is not None and digest in config.admin_key_digests)


#: Browsers cannot set Authorization on a WebSocket: they offer `bearer.<key>` as a
#: subprotocol instead, which the edge never selects (so never echoes).
SUBPROTOCOL_KEY_PREFIX = "bearer."


def subprotocol_key(offered: list[str]) -> str | None:
    """The API key in the first `bearer.<key>` subprotocol offered, or None."""
    for name in offered:
        if name.lower().startswith(SUBPROTOCOL_KEY_PREFIX):
            return name[len(SUBPROTOCOL_KEY_PREFIX) :] or None
    return None


def key_label(digest: str) -> str:
    """How logs name a key: a short prefix of its digest, never the key."""
    return f"sha256:{digest[:8]}"


class KeySessions:
    """Open sessions per key digest in this edge process, against each key's limit (0 =
    unlimited). The scheduler holds the key to the same limit across every edge
    (session.key_claim): this count answers 429 before the upgrade, that one after.

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
