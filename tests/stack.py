"""Start real service processes on 127.0.0.1 with free ports, for end-to-end tests.

The runner is the tools' (omnifabric.tools.perf.stack); here it runs from the repository
root with every wait scaled by OMNI_TEST_TIME_FACTOR.
"""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from omnifabric.tools.perf import stack as _stack
from tests.conftest import ROOT, TIME_FACTOR, scaled


@dataclass
class Service(_stack.Service):
    """One service process (see the tools' Service), its waits scaled."""

    time_factor: float = TIME_FACTOR


def start_service(name: str, module: str, args: list[str], log_dir: Path) -> _stack.Service:
    """Launch `python -m module args` with stdout and stderr into log_dir/name.log."""
    return _stack.start_service(name, module, args, log_dir, cwd=ROOT, time_factor=TIME_FACTOR)


class Stack(_stack.Stack):
    """A scheduler, workers and an edge as separate processes on free ports."""

    #: Seconds its reference worker took to be ready (set by start_reference_fabric).
    worker_ready_s: float = 0.0

    def __init__(self, log_dir: Path) -> None:
        super().__init__(log_dir, cwd=ROOT, time_factor=TIME_FACTOR)


def start_reference_fabric(log_dir: Path) -> Stack:
    """A scheduler and one reference worker (2 slots, `worker0`), without an edge: the
    worker loads its models and times a unit and a spoken reply before it is ready (15-30
    s on a 2-core host), so the files that need this worker share one (tests/conftest.py's
    `reference_fabric` fixture) and each starts its own edge on it (`edge_on`). The caller
    stops it; `worker_ready_s` says how long the worker took."""
    stack = Stack(log_dir)
    try:
        stack.start_scheduler()
        t0 = time.monotonic()
        stack.start_worker("--engine", "reference", "--slots", "2")
        stack.worker_ready_s = time.monotonic() - t0
    except BaseException:
        stack.stop()
        raise
    return stack


def edge_on(fabric: Stack, log_dir: Path, *edge_args: str) -> Stack:
    """A Stack of one edge (with `edge_args`) on `fabric`'s scheduler, its log in `log_dir`;
    stopping it stops that edge only. `worker_ready_s` is the fabric's."""
    stack = Stack(log_dir)
    stack.scheduler_address = fabric.scheduler_address
    stack.workers = list(fabric.workers)
    stack.worker_ready_s = fabric.worker_ready_s
    try:
        stack.start_edge(*edge_args)
    except BaseException:
        stack.stop()
        raise
    return stack


def read_until_line(proc: subprocess.Popen, prefix: str, timeout_s: float = 60.0) -> str:
    """Read a child's text stdout until a line starting with `prefix`; returns that line.
    AssertionError with everything read when the child ends or the (scaled) time is up."""
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith(prefix):
            return line
    raise AssertionError(f"no line starting {prefix!r}:\n" + "".join(lines))


def start_serve(*extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`omnifabric serve` on free ports (every service), output on its stdout pipe; `env`
    adds variables to the children's environment."""
    return _stack.start_serve(*extra, cwd=ROOT, env=env)


def stop_serve(proc: subprocess.Popen, timeout_s: float) -> str:
    """SIGINT to a started serve, its remaining output once it exited (the caller checks
    its return code). One that is still running after `timeout_s` is asked for every
    thread's stack (SIGUSR1), killed, and the test fails with all it printed."""
    proc.send_signal(signal.SIGINT)
    try:
        rest, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        proc.kill()
        rest, _ = proc.communicate()
        raise AssertionError(
            f"serve did not stop within {timeout_s:.0f} s after SIGINT:\n{rest}"
        ) from None
    return rest


def keyed_stack(tmp_path: Path, keys: str, *edge_args: str) -> Stack:
    """Scheduler, one synthetic worker (2 slots) and an edge with the key file `keys`
    (and `edge_args`): the stack the HTTP API tests share. The caller stops it."""
    stack = Stack(tmp_path)
    key_file = tmp_path / "keys"
    key_file.write_text(keys)
    stack.start_scheduler()
    stack.start_worker("--slots", "2", "--compute-ms", "5")
    stack.start_edge("--api-keys-file", str(key_file), *edge_args)
    return stack
