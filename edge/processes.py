"""`omnifabric edge --processes N`: N edge processes on one host, one WebSocket port and one
gRPC port between them.

This process (the supervisor) reserves both ports with SO_REUSEPORT sockets it binds but
never listens on, so port 0 resolves to one port for all and no other program can take
them while a child restarts. It starts N children with `--reuse-port` on those ports: the
kernel spreads new connections over the listening children. A child that exits is started
again (backoff 1 s doubling to 30 s). SIGTERM or SIGINT reaches every child at once; each
drains its own sessions (session.closed{server_shutdown}) within the drain grace, and
the supervisor exits when they have. Children get SIGTERM from the kernel if the
supervisor dies.

What lives in one edge process's memory stays per process, as between separate edges:
/status, /metrics (each scrape sees the process that took the connection; its
`edge_process` label says which), the half-duplex stop. Per-key session limits are the
fabric's: the scheduler counts each key's sessions of every process (AcquireRequest.key)."""

from __future__ import annotations

import socket
import sys
import time

from omnifabric.common import listen
from omnifabric.common.children import Child, StopRequest, spawn, stop
from omnifabric.edge.config import EdgeConfig

#: How long a child may take to report ready.
READY_TIMEOUT_S = 60.0
#: Restart backoff: first delay, cap, and the uptime after which a child counts as healthy.
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
HEALTHY_AFTER_S = 60.0


def reserve(host: str, port: int) -> socket.socket:
    """A bound, non-listening SO_REUSEPORT socket on host:port (port 0: a free one)."""
    try:
        return listen.bound_socket(host, port, reuse_port=True)
    except OSError as exc:
        raise listen.cannot_listen(host, port, exc) from None


class Supervisor:
    """Runs `count` edge children on reserved ports until stopped."""

    def __init__(self, config: EdgeConfig, argv: list[str]) -> None:
        self.config = config
        self.argv = argv
        self.count = config.processes
        self.reserved: list[socket.socket] = []
        self.port = 0
        self.grpc_port = -1
        self.children: list[Child | None] = [None] * self.count
        self.stopping = StopRequest()

    def child_args(self) -> list[str]:
        # Later flags win in argparse: these override whatever argv said.
        return [
            *self.argv,
            "--processes",
            "1",
            "--reuse-port",
            "--port",
            str(self.port),
            "--grpc-port",
            str(self.grpc_port),
        ]

    def start_child(self, index: int) -> Child:
        child = spawn(
            f"edge-{index + 1}",
            "omnifabric.edge",
            self.child_args(),
            env={"OMNI_EDGE_PROCESSES": "1", "OMNI_EDGE_PROCESS_INDEX": str(index + 1)},
            die_with_parent=True,
        )
        self.children[index] = child
        return child

    def run(self) -> int:
        try:
            ws = reserve(self.config.host, self.config.port)
            self.reserved.append(ws)
            self.port = ws.getsockname()[1]
            if self.config.grpc_port >= 0:
                grpc = reserve(self.config.host, self.config.grpc_port)
                self.reserved.append(grpc)
                self.grpc_port = grpc.getsockname()[1]
        except OSError as exc:
            print(f"omnifabric edge: {exc}", file=sys.stderr)
            return 2
        self.stopping.install()
        try:
            return self._serve()
        finally:
            running = [c for c in self.children if c is not None]
            stop(running, self.config.drain_grace_s, who="omnifabric edge")
            for sock in self.reserved:
                sock.close()

    def _serve(self) -> int:
        first = [self.start_child(i) for i in range(self.count)]
        try:
            texts = [c.wait_ready(READY_TIMEOUT_S) for c in first]
        except RuntimeError as exc:
            print(f"omnifabric edge: {exc}", file=sys.stderr)
            return 1
        print(f"omnifabric edge ready: {texts[0]} processes={self.count}", flush=True)
        started = [time.monotonic()] * self.count
        delay = [BACKOFF_FIRST_S] * self.count
        due: list[float | None] = [None] * self.count
        while not self.stopping.wait(0.2):
            now = time.monotonic()
            for i, child in enumerate(self.children):
                if due[i] is not None:
                    if now >= (due[i] or 0.0):
                        due[i] = None
                        self.start_child(i)
                        started[i] = now
                    continue
                assert child is not None
                if child.proc.poll() is None:
                    continue
                if now - started[i] >= HEALTHY_AFTER_S:
                    delay[i] = BACKOFF_FIRST_S
                print(
                    f"omnifabric edge: {child.name} exited ({child.proc.returncode}); "
                    f"starting it again in {delay[i]:g} s",
                    file=sys.stderr,
                    flush=True,
                )
                due[i] = now + delay[i]
                delay[i] = min(BACKOFF_MAX_S, 2 * delay[i])
        return 0


def run(config: EdgeConfig, argv: list[str]) -> int:
    """Supervise config.processes edge children (argv: this command's arguments)."""
    return Supervisor(config, argv).run()
