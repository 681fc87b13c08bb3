"""A throwaway redis-server (Debian's package) on a free loopback port, without persistence:
the election store of the active/standby tests and of `python -m omnifabric.tools.ha_rebuild`.
Never the system's service."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

BINARY = "redis-server"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the server binds it right after)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RedisServer:
    """One redis-server process."""

    port: int
    proc: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_redis(log_dir: Path, port: int | None = None, timeout_s: float = 10.0) -> RedisServer:
    """Start redis-server on 127.0.0.1 (`port`, or a free one) and wait until it answers.
    FileNotFoundError when the binary is not installed; RuntimeError when it does not start."""
    port = port or free_port()
    log_path = log_dir / f"redis-{port}.log"
    args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    return _start(
        [*args, "--logfile", str(log_path), "--dir", str(log_dir)], port, log_path, timeout_s
    )


def start_sentinel(
    log_dir: Path, master_port: int, service: str = "mymaster", timeout_s: float = 10.0
) -> RedisServer:
    """Start a Redis Sentinel on a free loopback port that names the redis-server on
    `master_port` as the master of `service` (the same binary, --sentinel mode)."""
    port = free_port()
    log_path = log_dir / f"sentinel-{port}.log"
    config = log_dir / f"sentinel-{port}.conf"  # a sentinel rewrites its own config file
    config.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {log_dir}\nlogfile {log_path}\n"
        f"sentinel monitor {service} 127.0.0.1 {master_port} 1\n"
        f"sentinel down-after-milliseconds {service} 1000\n"
    )
    return _start([str(config), "--sentinel"], port, log_path, timeout_s)


def _start(args: list[str], port: int, log_path: Path, timeout_s: float) -> RedisServer:
    binary = shutil.which(BINARY)
    if binary is None:
        raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
    proc = subprocess.Popen([binary, *args], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    server = RedisServer(port, proc, log_path)
    deadline = time.monotonic() + timeout_s
    while not server.ping():
        if proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            text = log_path.read_text() if log_path.exists() else ""
            raise RuntimeError(f"redis-server did not start on port {port}:\n{text[-2000:]}")
        time.sleep(0.02)
    return server
