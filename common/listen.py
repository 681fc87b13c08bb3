"""Where the fabric's gRPC servers listen: one rule for the edge, the scheduler and workers.

gRPC takes a listening address as one "host:port" string, so an IPv6 literal needs brackets
("[::1]:50051"; "::1:0" is not an address), and it reports a port it cannot bind by raising
RuntimeError in some versions and returning 0 in others. ``add_port`` turns both into an
OSError that names the address, which each service's entry point prints as one line.
"""

from __future__ import annotations

import os
import socket
from typing import Any

#: Hosts that mean "every interface": a client cannot dial them.
WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]"})
#: The IPv6 ones: every interface of both families where this module binds (``bound_socket``).
IPV6_WILDCARDS = frozenset({"::", "[::]"})


def bracketed(host: str) -> str:
    """``host`` as it goes before ":port": IPv6 literals in brackets, others as they are."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def target(host: str, port: int) -> str:
    """The "host:port" string gRPC listens on or dials."""
    return f"{bracketed(host)}:{port}"


def dial_host(host: str) -> str:
    """A host a client on this machine can dial for a server bound to ``host``: loopback
    for a wildcard bind (IPv6's for "::", which answers there whether or not the system
    lets an IPv6 socket take IPv4 too), IPv6 in brackets."""
    if host in IPV6_WILDCARDS:
        return "[::1]"
    return "127.0.0.1" if host in WILDCARDS else bracketed(host)


def bound_socket(
    host: str, port: int, *, reuse_port: bool = False, reuse_address: bool = False
) -> socket.socket:
    """A TCP socket bound (not listening) to ``host``:``port`` (0: a free port), for a server
    to listen on. An IPv6 wildcard ("::") takes IPv4 clients too, as gRPC's ports do: asyncio
    would bind it IPv6 only (it sets IPV6_V6ONLY), and a system may default to that.
    Raises the OSError of the bind."""
    host = host[1:-1] if host.startswith("[") else host
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if reuse_address:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def check_address(address: str) -> str:
    """``address`` when it is a "host:port" another process can dial; ValueError saying
    what is wrong otherwise (no port, a port that is no number or out of range, an IPv6
    literal without brackets: "::1:5000" could be port 5000 of ::1 or the address ::1:5000)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{address!r} is not host:port")
    if not 0 < int(port) < 65536:
        raise ValueError(f"{address!r}: port {port} is out of range (1-65535)")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(f"{address!r}: put an IPv6 address in brackets, e.g. [{host}]:{port}")
    return address


def cannot_listen(host: str, port: int, exc: OSError, what: str = "listen on") -> OSError:
    """The OSError a service stops with when it cannot listen on ``host``:``port``: the
    address and the system's reason in one line ("cannot listen on [::1]:8006: Address
    already in use")."""
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    error = OSError(f"cannot {what} {target(host, port)}: {reason}")
    error.errno = exc.errno
    return error


def add_port(server: Any, host: str, port: int, credentials: Any = None) -> int:
    """Have grpc ``server`` (sync or aio, not started) listen on ``host``:``port``, with TLS
    when ``credentials`` are given; returns the bound port (the chosen one for port 0).
    Raises OSError naming the address when it cannot be bound (taken, or not this host's)."""
    address = target(host, port)
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError:
        bound = 0
    if not bound:
        raise OSError(
            f"cannot listen on {address}: the port is in use or the address is not this host's"
        )
    return int(bound)
