"""The processes one `omnifabric bench` run measures: scheduler, synthetic workers and edge
(tools.serve's children) and the echo server, started for the measured paths and stopped
in order; and the wait for the edge to go idle between levels."""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnifabric.tools.perf.ledger import THROUGH_EDGE
from omnifabric.tools.perf.metrics import http_address, metric, scrape_metrics

#: The baseline paths served by a server of the bench's own: the process that serves each.
BASELINE_SERVERS = {
    "ws-echo": "echo",
    "grpc-echo": "grpc-echo",
    "grpc-thread": "grpc-echo",
    "grpc-sync": "grpc-sync",
}
#: Those servers' process names: no path but their own watches them.
ECHOES = tuple(dict.fromkeys(BASELINE_SERVERS.values()))


@dataclass
class BenchStack:
    """Scheduler, workers and edge (tools.serve's children), plus the echo server."""

    children: list[Any]
    url: str
    scheduler: str
    echo_url: str
    pids: dict[str, int]
    grpc: str = ""
    """The edge's RealtimeService address (HOST:PORT): the grpc-realtime path."""
    grpc_echo: str = ""
    """The gRPC echo server's address (HOST:PORT): the grpc-echo and grpc-thread paths."""
    grpc_sync: str = ""
    """The synchronous gRPC server's address (HOST:PORT): the grpc-sync path."""

    def stop(self) -> None:
        from omnifabric.common.children import stop

        for kind in (*ECHOES, "edge", "worker", "scheduler"):
            group = [c for c in self.children if c.name.rstrip("0123456789") == kind]
            stop(group, 2.0, who="omnifabric bench")


def start_stack(args: argparse.Namespace, paths: list[str], log_dir: Path) -> BenchStack:
    """Start what the measured paths need: scheduler and synthetic workers (fabric or
    grpc-realtime without --url, grpc-direct), the edge (fabric or grpc-realtime without
    --url), the echo servers (ws-echo; grpc-echo and grpc-thread; grpc-sync)."""
    pids: dict[str, int] = {"client": os.getpid()}
    if args.edge_pid:
        pids["edge"] = args.edge_pid
    stack = BenchStack([], args.url or "", "", "", pids, args.grpc or "")
    own_fabric = any(p in THROUGH_EDGE for p in paths) and not args.url
    try:
        if own_fabric or "grpc-direct" in paths:
            _start_scheduler_and_workers(args, stack, log_dir)
        if own_fabric:
            _start_edge(args, stack, log_dir)
        _start_echoes(args, paths, stack, log_dir)
    except BaseException:
        stack.stop()
        raise
    return stack


def _start_scheduler_and_workers(
    args: argparse.Namespace, stack: BenchStack, log_dir: Path
) -> None:
    """The scheduler, then --workers synthetic workers on it, all ready (the first to
    start: the stack's children are these)."""
    from omnifabric.common.children import spawn

    host, children, pids = args.host, stack.children, stack.pids
    sched = spawn(
        "scheduler",
        "omnifabric.scheduler",
        ["--host", host, "--port", "0", "--metrics-port", "0", "--grace", "2"],
        log_dir / "scheduler.log",
    )
    children.append(sched)
    stack.scheduler = sched.wait_ready(args.ready_timeout).split()[0]
    pids["scheduler"] = sched.proc.pid
    for i in range(args.workers):
        worker = spawn(
            f"worker{i}",
            "omnifabric.worker",
            [
                *("--host", host, "--port", "0", "--metrics-port", "0"),
                *("--scheduler", stack.scheduler, "--engine", "synthetic"),
                *("--slots", str(args.slots), "--compute-ms", str(args.compute_ms)),
                *("--worker-id", f"bench-w{i}", "--grace", "2"),
            ],
            log_dir / f"worker{i}.log",
        )
        children.append(worker)
        pids[f"worker{i}"] = worker.proc.pid
    for child in children[1:]:
        child.wait_ready(args.ready_timeout)


def _start_edge(args: argparse.Namespace, stack: BenchStack, log_dir: Path) -> None:
    """The edge on the stack's scheduler: its URL and gRPC address, and its pid (or, with
    --edge-processes N, its supervisor's and its processes')."""
    from omnifabric.common.children import spawn

    pids = stack.pids
    edge = spawn(
        "edge",
        "omnifabric.edge",
        [
            *("--host", args.host, "--port", "0", "--grpc-port", "0"),
            *("--scheduler", stack.scheduler, "--grace", "2"),
            *("--processes", str(args.edge_processes)),
        ],
        log_dir / "edge.log",
    )
    stack.children.append(edge)
    words = edge.wait_ready(args.ready_timeout).split()
    stack.url = words[0]
    stack.grpc = next(w.removeprefix("grpc=") for w in words if w.startswith("grpc="))
    if args.edge_processes == 1:
        pids["edge"] = edge.proc.pid
    else:  # the supervisor and its edge processes, summed as the edge
        pids["edge-supervisor"] = edge.proc.pid
        for i, pid in enumerate(child_pids(edge.proc.pid)):
            pids[f"edge-{i + 1}"] = pid


def _start_echoes(
    args: argparse.Namespace, paths: list[str], stack: BenchStack, log_dir: Path
) -> None:
    """The echo servers the measured baseline paths need."""

    def start_echo(name: str, flag: str, ready: str, *more: str) -> str:
        return _start_echo(args, stack, log_dir, name, flag, ready, *more)

    if "ws-echo" in paths:
        stack.echo_url = start_echo("echo", "--echo-server", "echo ready: ")
    if "grpc-echo" in paths or "grpc-thread" in paths:
        stack.grpc_echo = start_echo(
            "grpc-echo", "--grpc-echo-server", "grpc echo ready: ", str(args.compute_ms)
        )
    if "grpc-sync" in paths:
        stack.grpc_sync = start_echo(
            "grpc-sync", "--grpc-sync-server", "grpc sync ready: ", str(args.compute_ms)
        )


def _start_echo(
    args: argparse.Namespace,
    stack: BenchStack,
    log_dir: Path,
    name: str,
    flag: str,
    ready: str,
    *more: str,
) -> str:
    """An echo server of the bench's own (`bench FLAG HOST [MORE]`); returns the address
    its ready line names."""
    from omnifabric.common.children import spawn

    log = log_dir / f"{name}.log"
    echo = spawn(name, "omnifabric.tools.perf.bench", [flag, args.host, *more], log)
    stack.children.append(echo)
    wait_line(echo, log, ready, args.ready_timeout)
    stack.pids[name] = echo.proc.pid
    return log.read_text().split(ready)[1].split()[0]


def child_pids(parent: int) -> list[int]:
    """The live child processes of `parent`, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            found.append(int(entry.name))
    return sorted(found)


def wait_line(child: Any, log: Path, prefix: str, timeout_s: float) -> None:
    """Until `prefix` shows in the child's log file (RuntimeError if it exits or times out)."""
    deadline = time.monotonic() + timeout_s
    while prefix not in (log.read_text() if log.exists() else ""):
        if child.proc.poll() is not None:
            raise RuntimeError(f"{child.name} exited ({child.proc.returncode}): {log}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{child.name} not ready after {timeout_s:.0f} s: {log}")
        time.sleep(0.05)


async def edge_idle(url: str, timeout_s: float) -> bool:
    """Until the edge has no open session (the last level's closes are done)."""
    address = http_address(url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            page = await asyncio.to_thread(scrape_metrics, address)
            active = metric(page, "omni_edge_sessions_active")
        except OSError:
            return False
        if active == 0:
            return True
        await asyncio.sleep(0.2)
    return False
