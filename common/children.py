"""Service child processes: start one (`python -m module ...`), note its ready line, stop a
group within a grace. Used by `omnifabric serve` (the whole stack) and by
`omnifabric edge --processes N` (N edge processes on one port)."""

from __future__ import annotations

import ctypes
import faulthandler
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TextIO

READY = re.compile(r"^omnifabric (scheduler|worker|edge) ready: (.*)$")
#: Time a child gets after its own drain grace to exit before it is killed.
STOP_MARGIN_S = 5.0
_PR_SET_PDEATHSIG = 1


@dataclass
class Child:
    """A service child process and what its ready line said."""

    name: str
    proc: subprocess.Popen
    ready: threading.Event = field(default_factory=threading.Event)
    ready_text: str = ""
    log: TextIO | None = None
    """Where its output goes (None: our stdout, each line prefixed with its name)."""

    def pump(self) -> None:
        """Forward the child's output; note its ready line."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            match = READY.match(line.strip())
            first_ready = bool(match) and not self.ready.is_set()
            if match and first_ready:
                self.ready_text = match.group(2)
                self.ready.set()
            if self.log is not None:
                self.log.write(line)
                self.log.flush()
            elif not first_ready:
                sys.stdout.write(f"[{self.name}] {line}")
                sys.stdout.flush()
        if self.log is not None:
            self.log.close()

    def wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(0.1):
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with code {self.proc.returncode} before ready"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f}s")
        return self.ready_text


class StopRequest:
    """SIGINT/SIGTERM asking a supervisor's main loop to stop.

    The handler only assigns an attribute. A Python signal handler runs in the main
    thread between two of its bytecodes, so one that takes a lock deadlocks when the main
    thread held that lock at that moment: `threading.Event.set` from a handler hangs for
    good if the signal lands while `Event.wait` holds the event's own lock (a supervisor
    then never stops). `wait` polls the attribute instead."""

    POLL_S = 0.05

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        """Handle SIGINT and SIGTERM; and SIGUSR1 prints every thread's stack to stderr
        (faulthandler, which needs neither the main thread nor a lock: what a supervisor
        that does not stop is doing, `kill -USR1 PID`)."""
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)
        if hasattr(signal, "SIGUSR1"):
            faulthandler.register(signal.SIGUSR1, all_threads=True)

    def _on_signal(self, _signum: int, _frame: FrameType | None) -> None:
        self.requested = True

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to timeout_s or until a stop is asked; True when one was."""
        deadline = time.monotonic() + timeout_s
        while not self.requested:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(left, self.POLL_S))
        return self.requested


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the parent dies, so a parent killed
    with SIGKILL leaves no service running on its ports. Elsewhere a no-op."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def spawn(
    name: str,
    module: str,
    args: list[str],
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
    die_with_parent: bool = False,
) -> Child:
    """Start `python -m module args`; its stdout (and stderr, with `log_path`) is pumped
    to our stdout or to `log_path`. `env` is added to ours; `die_with_parent` asks the
    kernel to SIGTERM the child when we die."""
    environ = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=None if log_path is None else subprocess.STDOUT,
        text=True,
        env=environ,
        start_new_session=True,  # Ctrl-C reaches us only; we stop children in order.
        preexec_fn=_die_with_parent if die_with_parent else None,
    )
    child = Child(name, proc, log=None if log_path is None else open(log_path, "a"))
    threading.Thread(target=child.pump, name=f"pump-{name}", daemon=True).start()
    return child


def stop(children: list[Child], grace_s: float, who: str = "omnifabric serve") -> None:
    """SIGTERM every child at once (each drains within its own grace), wait, and SIGKILL
    a child still running STOP_MARGIN_S after the grace."""
    running = [c for c in children if c.proc.poll() is None]
    if not running:
        return
    print(
        f"{who}: draining {', '.join(c.name for c in running)} (grace {grace_s:g} s)",
        flush=True,
    )
    for child in running:
        child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s + STOP_MARGIN_S
    for child in running:
        try:
            child.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"{who}: {child.name} still running: killed", flush=True)
            child.proc.kill()
            child.proc.wait()
        else:
            print(f"{who}: {child.name} exited ({child.proc.returncode})", flush=True)
