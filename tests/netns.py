"""Separate hosts on one Linux machine for tests: network namespaces joined by veth links
to a bridge in a "switch" namespace. Needs root and iproute2; the root namespace's own
networking is never touched."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tests.conftest import scaled

#: Every namespace made here is named PREFIX<pid of the creating process>-<host>.
PREFIX = "of-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-[\w-]+$")
_CLONE_NEWNET = 0x40000000
_BRIDGE = "br0"
_IFACE = "eth0"


class NetnsError(RuntimeError):
    """An `ip` command failed; the message holds the command and its stderr."""


def ip(*args: str, check: bool = True) -> str:
    """Run `ip ARGS`; returns stdout. Raises NetnsError (command and stderr) on failure."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=scaled(30))
    if check and result.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")
    return result.stdout


def unavailable_reason() -> str | None:
    """Why namespaces, veth links and bridges cannot be made here, or None when they can.

    Tries the real thing once (a namespace with a bridge and a veth pair in it)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        ip("netns", "add", probe)
    except NetnsError as exc:
        return str(exc)
    try:
        ip("-n", probe, "link", "add", _BRIDGE, "type", "bridge")
        ip("-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb")
    except NetnsError as exc:
        return str(exc)
    finally:
        ip("netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie (killed, not yet reaped by its parent) does not."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # "pid (comm) S ...": the state follows the last ')', comm may hold any.
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def namespaces() -> list[str]:
    """Names of every named network namespace (`ip netns list`)."""
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def kill_inside(name: str, timeout_s: float = 5.0) -> None:
    """SIGKILL every process in namespace `name`, and wait until none is left (at most
    timeout_s, scaled). Zombies do not count: a process leaves its namespaces as it exits."""
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        pids = [int(p) for p in ip("netns", "pids", name, check=False).split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def remove_stale() -> list[str]:
    """Delete the namespaces (and kill their processes) of earlier runs whose creating
    process is gone; returns their names. Live runs' namespaces are left alone."""
    removed = []
    for name in namespaces():
        match = _NAME.match(name)
        if match and not _alive(int(match.group(1))):
            kill_inside(name)
            ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


class Network:
    """Hosts on one /24 behind a switch: each host is a namespace named PREFIX<pid>-<host>
    whose eth0 (address subnet.N, N = 2, 3, ... in `hosts` order) is a veth whose other end,
    p-<host>, is a port of the bridge in the switch namespace."""

    def __init__(self, hosts: list[str], subnet: str = "10.77.0") -> None:
        for host in hosts:
            if not re.fullmatch(r"[\w-]{1,13}", host):  # p-<host> must fit IFNAMSIZ
                raise ValueError(f"host name {host!r}: 1-13 letters, digits, '_' or '-'")
        self.tag = f"{PREFIX}{os.getpid()}-"
        self.hosts = list(hosts)
        self.switch = self.tag + "switch"
        self._addresses = {host: f"{subnet}.{i}" for i, host in enumerate(self.hosts, 2)}
        self._made: list[str] = []

    def ns(self, host: str) -> str:
        """Namespace name of `host`."""
        return self.tag + host

    def address(self, host: str) -> str:
        """IPv4 address of `host` on the shared link."""
        return self._addresses[host]

    def exec_prefix(self, host: str) -> list[str]:
        """Argument prefix that runs a command inside `host`'s namespace."""
        return ["ip", "netns", "exec", self.ns(host)]

    def port(self, host: str) -> str:
        """Name of `host`'s bridge port in the switch namespace."""
        return f"p-{host}"

    def create(self) -> None:
        """Make the switch and every host. Raises NetnsError; destroy() cleans up either way."""
        self._add(self.switch)
        ip("-n", self.switch, "link", "add", _BRIDGE, "type", "bridge")
        ip("-n", self.switch, "link", "set", _BRIDGE, "up")
        for host in self.hosts:
            name = self.ns(host)
            self._add(name)
            port = self.port(host)
            ip("-n", self.switch, "link", "add", port, "type", "veth",
               "peer", "name", _IFACE, "netns", name)  # fmt: skip
            ip("-n", self.switch, "link", "set", port, "master", _BRIDGE, "up")
            ip("-n", name, "addr", "add", f"{self.address(host)}/24", "dev", _IFACE)
            ip("-n", name, "link", "set", _IFACE, "up")
            ip("-n", name, "link", "set", "lo", "up")

    def cut(self, host: str) -> None:
        """Pull `host`'s cable: its bridge port goes down, so nothing reaches it or leaves it
        (its own interface keeps its address; its processes see only silence)."""
        ip("-n", self.switch, "link", "set", self.port(host), "down")

    def restore(self, host: str) -> None:
        """Plug `host`'s cable back in."""
        ip("-n", self.switch, "link", "set", self.port(host), "up")

    def destroy(self) -> None:
        """Kill every process inside the namespaces made here, then delete them."""
        for name in reversed(self._made):
            kill_inside(name)
            ip("netns", "del", name, check=False)
        self._made.clear()

    def _add(self, name: str) -> None:
        ip("netns", "add", name)
        self._made.append(name)


def _setns(fd: int) -> None:
    setns = getattr(os, "setns", None)  # Python 3.12+
    if setns is not None:
        setns(fd, _CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextmanager
def entered(name: str) -> Iterator[None]:
    """Move the calling thread into namespace `name` and back on exit. Sockets opened
    meanwhile (on this thread) belong to that namespace for good, and so do threads this
    thread starts meanwhile; other threads stay where they are."""
    with open("/proc/thread-self/ns/net") as home, open(f"/var/run/netns/{name}") as target:
        _setns(target.fileno())
        try:
            yield
        finally:
            _setns(home.fileno())
