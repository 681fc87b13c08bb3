"""Running one level of `omnifabric bench`: N concurrent sessions over one path, with the
processes watched, progress lines, the streaming window and the client's loop lag; again
when the host's steal spoiled it; and the edge's flame graph (--profile)."""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omnifabric.common.stats import percentile
from omnifabric.tools.perf import console
from omnifabric.tools.perf.baselines import echo_session
from omnifabric.tools.perf.bench_stack import BASELINE_SERVERS, ECHOES, BenchStack, edge_idle
from omnifabric.tools.perf.fabric import fabric_session
from omnifabric.tools.perf.ledger import THROUGH_EDGE, Level, Samples, stats, us_per_unit
from omnifabric.tools.perf.procs import ProcessWatch, proc_sample
from omnifabric.tools.perf.units import append_frame, pcm, unit_script


def say(text: str) -> None:
    """A progress line of `omnifabric bench`."""
    console.say("bench", text)


@dataclass
class LevelRun:
    """What one level's background tasks share while its sessions run: the samples they
    read, and the streaming window's two ends and the loop lags they note."""

    path: str
    sessions: int
    args: argparse.Namespace
    samples: Samples
    started: float = 0.0
    steady: list[tuple[float, float | None, int]] = field(default_factory=list)
    """The streaming window: from the moment every session has sent its first unit to the
    moment one sends its last. Both ends: (time, edge CPU s or None, units answered)."""
    lags: list[float] = field(default_factory=list)

    async def progress(self) -> None:
        """A progress line every --progress-every s."""
        args, samples = self.args, self.samples
        while True:
            await asyncio.sleep(args.progress_every)
            p99 = percentile(samples.overhead, 99) if samples.overhead else math.nan
            say(
                f"{self.path} x{self.sessions}: {time.monotonic() - self.started:.0f}/"
                f"{args.seconds} s, "
                f"{len(samples.overhead)}/{samples.sent} answered, overhead p99 so far "
                f"{p99:.1f} ms"
            )

    async def steady_window(self, stack: BenchStack) -> None:
        """Note the streaming window's two ends (`steady`), when the run is long enough."""
        pids = edge_pids(stack.pids) if self.path in THROUGH_EDGE else []
        if self.args.seconds < 3:
            return
        for mark in (self.sessions, self.sessions * (self.args.seconds - 1)):
            while self.samples.sent < mark:
                await asyncio.sleep(0.02)
            cpus = [sample[0] for pid in pids if (sample := proc_sample(pid)) is not None]
            cpu = sum(cpus) if pids and len(cpus) == len(pids) else None
            self.steady.append((time.monotonic(), cpu, len(self.samples.overhead)))

    async def loop_lag(self) -> None:
        """The client's own event loop: a late wake-up here delays every timestamp it takes,
        so a high lag means the measurement, not the fabric, is the bottleneck."""
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.01)
            self.lags.append((time.monotonic() - before - 0.01) * 1000.0)


def session_runs(
    path: str,
    units: list[Any],
    delays: list[float],
    samples: Samples,
    stack: BenchStack,
    grpc_clients: dict[str, Any],
) -> list[Coroutine[Any, Any, None]]:
    """One session per delay over `path`, each sending `units`."""
    if path == "fabric":
        frames = [append_frame(u) for u in units]
        url = f"{stack.url}?mode=audio"
        return [fabric_session(url, d, units, frames, samples) for d in delays]
    if path == "ws-echo":
        frames = [append_frame(u) for u in units]
        return [echo_session(stack.echo_url, d, units, frames, samples) for d in delays]
    pcms = [pcm(u) for u in units]
    client = grpc_clients[path]  # made whenever the path is measured
    return [client.session(d, units, pcms, samples) for d in delays]


def watched_names(path: str, args: argparse.Namespace, stack: BenchStack) -> list[str]:
    """The processes a level over `path` watches, by their names in the stack's pids."""
    if path in THROUGH_EDGE:
        # A fabric of its own: every service; a --url fabric: the client (and --edge-pid).
        return [
            n
            for n in stack.pids
            if n not in ECHOES and (not args.url or n == "client" or is_edge(n))
        ]
    if path in BASELINE_SERVERS:
        return [BASELINE_SERVERS[path], "client"]
    return [n for n in stack.pids if n.startswith(("worker", "scheduler")) or n == "client"]


async def run_level(
    path: str,
    sessions: int,
    args: argparse.Namespace,
    stack: BenchStack,
    grpc_clients: dict[str, Any],
) -> Level:
    """N concurrent sessions over one path, with a progress line every --progress-every s.
    `grpc_clients`: the client of each gRPC path measured (grpc-realtime, grpc-echo,
    grpc-thread, grpc-sync, grpc-direct), by path; each has `session(delay_s, units, pcms,
    samples)`."""
    units = unit_script(args.seconds)
    run = LevelRun(path, sessions, args, Samples())
    # Session i opens at i * ramp / N s; its units follow once a second from then on, so
    # the units of all sessions stay spread over each second whatever the ramp.
    delays = [i * args.ramp_s / sessions for i in range(sessions)]
    runs = session_runs(path, units, delays, run.samples, stack, grpc_clients)
    watch = ProcessWatch({n: stack.pids[n] for n in watched_names(path, args, stack)})
    run.started = time.monotonic()
    say(f"{path} x{sessions}: {sessions} sessions x {args.seconds} s")
    profiler = _start_profile(args, stack, path, sessions)
    watch.start()
    lagger = asyncio.create_task(run.loop_lag())
    ticker = asyncio.create_task(run.progress())
    window = asyncio.create_task(run.steady_window(stack))
    try:
        await asyncio.gather(*runs)
    finally:
        ticker.cancel()
        window.cancel()
        lagger.cancel()
        if profiler is not None:
            await _finish_profile(profiler)
    level = await level_figures(run, watch)
    say(level_line(level))
    if path in THROUGH_EDGE and stack.url:
        await edge_idle(stack.url, 30)
    return level


async def level_figures(run: LevelRun, watch: ProcessWatch) -> Level:
    """The level's figures once its sessions are over: the samples', the watched
    processes', the edge's CPU per unit and the streaming window's."""
    samples = run.samples
    level = samples.fill(Level(run.path, run.sessions, run.args.seconds))
    level.client_loop_lag_ms = stats(run.lags)
    level.processes = await watch.stop()
    level.wall_s = round(watch.wall_s, 2)
    level.machine_cores = round(watch.machine_cores, 2)
    level.steal_cores = round(watch.steal_cores, 2)
    edge_cpu_s = [p["cpu_s"] for n, p in level.processes.items() if is_edge(n)]
    if edge_cpu_s and level.answered:
        level.edge_cpu_us_per_unit = us_per_unit(sum(edge_cpu_s), level.answered)
    if len(run.steady) == 2:
        (t0, cpu0, n0), (t1, cpu1, n1) = run.steady
        level.overhead_streaming_ms = stats(
            [o for o, at in zip(samples.overhead, samples.sent_at, strict=True) if t0 <= at < t1]
        )
        if cpu0 is not None and cpu1 is not None and n1 > n0:
            level.edge_cpu_us_per_unit_steady = us_per_unit(cpu1 - cpu0, n1 - n0)
    return level


def level_line(level: Level) -> str:
    """The progress line that ends a level: its counts and overhead, and the figures it
    has of the streaming window, the worker, the client's loop lag and the edge's CPU."""
    o = level.overhead_ms
    steady_us = level.edge_cpu_us_per_unit_steady
    return (
        f"{level.path} x{level.sessions}: {level.answered}/{level.units_sent} answered, "
        f"lost {level.lost}, "
        f"dropped {level.dropped}, lost sessions {level.lost_sessions}; overhead p50 "
        f"{o['p50']:.2f} / p95 {o['p95']:.2f} / p99 {o['p99']:.2f} ms"
        + (
            f", while all stream p99 {level.overhead_streaming_ms['p99']:.2f}"
            if level.overhead_streaming_ms
            else ""
        )
        + (
            f" (in the worker p50 {level.in_worker_ms['p50']:.2f} / p99 "
            f"{level.in_worker_ms['p99']:.2f}; client loop lag p99 "
            f"{level.client_loop_lag_ms['p99']:.2f})"
            if math.isfinite(level.in_worker_ms["p50"])
            else ""
        )
        + (
            f"; edge CPU per unit {level.edge_cpu_us_per_unit:.0f} us "
            f"(streaming only: {math.nan if steady_us is None else steady_us:.0f} us)"
            if level.edge_cpu_us_per_unit is not None
            else ""
        )
        + (f"; errors {level.errors}" if level.errors else "")
    )


async def measure(
    path: str,
    sessions: int,
    args: argparse.Namespace,
    stack: BenchStack,
    grpc_clients: dict[str, Any],
) -> Level:
    """run_level, again (up to --noisy-retries times) when the machine's host took more than
    --max-steal cores meanwhile: on a shared virtual machine, steal alone moves the tail
    several-fold. The attempts set aside stay in the result (`noisy_attempts`)."""
    noisy: list[dict[str, Any]] = []
    while True:
        level = await run_level(path, sessions, args, stack, grpc_clients)
        if level.steal_cores <= args.max_steal or len(noisy) >= args.noisy_retries:
            level.noisy_attempts = noisy
            return level
        say(
            f"{path} x{sessions}: the host took {level.steal_cores:.2f} cores (steal) meanwhile, "
            f"more than --max-steal {args.max_steal:g}: measuring it again"
        )
        noisy.append(
            {
                "steal_cores": level.steal_cores,
                "overhead_ms": level.overhead_ms,
                "lost": level.lost,
                "lost_sessions": level.lost_sessions,
                "dropped": level.dropped,
            }
        )


def is_edge(name: str) -> bool:
    """An edge process's name in a stack's pids: `edge`, or `edge-N` and `edge-supervisor`
    under `--edge-processes N`."""
    return name == "edge" or name.startswith("edge-")


def edge_pids(pids: dict[str, int]) -> list[int]:
    return [pid for name, pid in pids.items() if is_edge(name)]


def _start_profile(args: argparse.Namespace, stack: BenchStack, path: str, sessions: int) -> Any:
    """py-spy on the edge for a fabric level (--profile): a flame graph SVG in --out."""
    import shutil
    import subprocess

    pid = stack.pids.get("edge") or stack.pids.get("edge-1")  # the first of several
    if not args.profile or path != "fabric" or pid is None:
        return None
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        say("--profile: py-spy is not installed (pip install py-spy); not profiling")
        return None
    target = args.out / f"profile-edge-x{sessions}.svg"
    say(f"profiling the edge (pid {pid}) with py-spy into {target}")
    return subprocess.Popen(
        [spy, "record", "-p", str(pid), "-r", "200", "--nonblocking", "-o", str(target)],
        stdout=subprocess.DEVNULL,
        stderr=open(args.out / "logs" / f"py-spy-x{sessions}.log", "w"),
    )


async def _finish_profile(proc: Any) -> None:
    """Stop py-spy with SIGINT: it writes the flame graph on the way out."""
    import signal

    proc.send_signal(signal.SIGINT)
    try:
        await asyncio.to_thread(proc.wait, 30)
    except Exception:
        proc.kill()
