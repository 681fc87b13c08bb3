"""Real service processes on free ports of 127.0.0.1: a scheduler, workers and an edge as a
Stack (the stack each `omnifabric soak` row runs on, and the end-to-end tests' one), and
`omnifabric serve` as one process.

Every wait is multiplied by `time_factor` (1 here; the tests pass OMNI_TEST_TIME_FACTOR).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from omnifabric.common.children import READY


@dataclass
class Service:
    """One service process; `ready_words` holds the words of its ready line."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    ready_words: list[str] = field(default_factory=list)
    _ready: threading.Event = field(default_factory=threading.Event)
    time_factor: float = 1.0

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log_path, "a") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                match = READY.match(line.strip())
                if match and not self._ready.is_set():
                    self.ready_words = match.group(2).split()
                    self._ready.set()

    def wait_ready(self, timeout_s: float = 30.0) -> list[str]:
        deadline = time.monotonic() + timeout_s * self.time_factor
        while not self._ready.wait(0.05):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready:\n{self.log()}")
        return self.ready_words

    def metrics_address(self) -> str:
        """host:port of the /metrics server its ready line named (metrics=...), or ""."""
        for word in self.ready_words:
            if word.startswith("metrics="):
                return word.removeprefix("metrics=")
        return ""

    def log(self) -> str:
        return self.log_path.read_text()[-4000:] if self.log_path.exists() else ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s * self.time_factor)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_service(
    name: str,
    module: str,
    args: list[str],
    log_dir: Path,
    *,
    cwd: Path | None = None,
    time_factor: float = 1.0,
) -> Service:
    """Launch `python -m module args` (in `cwd`) with stdout and stderr into
    log_dir/name.log."""
    log_path = log_dir / f"{name}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=cwd,
        env=env,
    )
    service = Service(name, proc, log_path, time_factor=time_factor)
    threading.Thread(target=service._pump, daemon=True).start()
    return service


class Stack:
    """A scheduler, workers and an edge as separate processes on free ports."""

    def __init__(self, log_dir: Path, *, cwd: Path | None = None, time_factor: float = 1.0) -> None:
        self.log_dir = log_dir
        self.cwd = cwd
        self.time_factor = time_factor
        self.services: list[Service] = []
        self.scheduler_address = ""
        self.workers: list[Service] = []
        self.edge: Service | None = None
        self.url = ""
        self.grpc_address = ""

    def _start(self, name: str, module: str, args: list[str]) -> Service:
        svc = start_service(
            name, module, args, self.log_dir, cwd=self.cwd, time_factor=self.time_factor
        )
        self.services.append(svc)
        return svc

    def start_scheduler(self, *extra: str) -> Service:
        args = ["--port", "0", "--metrics-port", "0", *extra]
        svc = self._start("scheduler", "omnifabric.scheduler", args)
        self.scheduler_address = svc.wait_ready()[0]
        return svc

    def restart_scheduler(self, *extra: str, name: str = "scheduler-restarted") -> Service:
        """A new scheduler on the port of the previous one (which must have exited), so
        that workers and edges find it again by themselves."""
        port = self.scheduler_address.rsplit(":", 1)[1]
        args = ["--port", port, "--metrics-port", "0", *extra]
        svc = self._start(name, "omnifabric.scheduler", args)
        svc.wait_ready()
        return svc

    def start_worker(self, *extra: str, name: str | None = None) -> Service:
        name = name or f"worker{len(self.workers)}"
        args = ["--port", "0", "--metrics-port", "0", "--scheduler", self.scheduler_address]
        args += ["--worker-id", name, *extra]
        svc = self._start(name, "omnifabric.worker", args)
        self.workers.append(svc)
        # A reference worker loads its models and times a unit and a spoken reply before it
        # is ready: 15-17 s on a quiet 2-core host, twice that on a loaded one.
        svc.wait_ready(90.0)
        return svc

    def start_edge(self, *extra: str, name: str = "edge") -> Service:
        """An edge (the stack's `edge` and `url` are the last one started)."""
        args = ["--port", "0", "--grpc-port", "0", "--scheduler", self.scheduler_address, *extra]
        svc = self._start(name, "omnifabric.edge", args)
        self.edge = svc
        words = svc.wait_ready()
        self.url = words[0]
        self.grpc_address = words[1].removeprefix("grpc=")
        return svc

    def stop(self) -> None:
        for svc in reversed(self.services):
            svc.stop()


def start_serve(
    *extra: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`omnifabric serve` on free ports (every service), its output on its stdout pipe;
    `env` adds variables to the children's environment."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    ports = ["--port", "0", "--grpc-port", "0", "--scheduler-port", "0"]
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "omnifabric.tools.cli",
            "serve",
            *extra,
            *ports,
            "--worker-base-port",
            "0",
        ],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
