"""The `omnifabric soak` rows that run for long: L1 (N sessions for S seconds, every
service's figures before and after), L2 (one session until the audio limit), L3 (sessions
in a row on a reference worker, its RSS after each) and FUZZ (tests/fuzz in a pytest
subprocess)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omnifabric.tools.perf.console import say
from omnifabric.tools.perf.metrics import http_address, metric
from omnifabric.tools.perf.procs import cpu_seconds
from omnifabric.tools.perf.soak_row import (
    ROOT,
    RowResult,
    checked,
    fabric_idle,
    print_progress,
    process_figures,
    row_stack,
    scrape,
    wait_until,
)
from omnifabric.tools.perf.stack import Stack

SPEECH_FIXTURE = ROOT / "tests" / "fixtures" / "speech" / "question.wav"


Figures = dict[str, dict[str, float]]
"""RSS (MiB), open fds and live asyncio tasks of every service, by name (process_figures)."""


@dataclass
class L1Run:
    """What L1's steps hand on to its verdict."""

    before: Figures = field(default_factory=dict)
    after: Figures = field(default_factory=dict)
    result: dict[str, Any] = field(default_factory=dict)
    """tools.load's figures of the measured run."""
    cpu: dict[str, float] = field(default_factory=dict)
    idle: bool = False
    edge_rss: list[float] = field(default_factory=list)
    """MiB, one per progress line: plateau or steady climb?"""


async def row_l1(args: argparse.Namespace, log_dir: Path) -> RowResult:
    """L1: a warm-up round, the baseline, N sessions x S s, then the same figures again."""
    target = (
        f"0 lost units and sessions; overhead p99 <= {args.max_overhead_p99_ms:g} ms; tasks "
        f"and fds back to their level; RSS growth < {args.max_rss_growth:g}%"
    )
    stack = row_stack(log_dir, "L1")
    run = L1Run()
    try:
        url = _l1_start(args, stack)
        run.before = await _l1_baseline(args, stack, url)
        run.result, run.cpu = await _l1_load(args, stack, url, run.edge_rss)
        run.idle, run.after = await _l1_recover(args, stack, run.before)
    finally:
        stack.stop()
    return _l1_verdict(args, target, run)


def _l1_start(args: argparse.Namespace, stack: Stack) -> str:
    """The scheduler, --workers workers and the edge; returns the sessions' URL."""
    say("L1", f"starting scheduler, {args.workers} workers x {args.slots} slots, edge")
    stack.start_scheduler()
    for i in range(args.workers):
        stack.start_worker(
            "--slots", str(args.slots), "--compute-ms", str(args.compute_ms), name=f"w{i}"
        )
    stack.start_edge()
    return f"{stack.url}?mode=audio"


async def _l1_baseline(args: argparse.Namespace, stack: Stack, url: str) -> Figures:
    """The warm-up round, then every service's figures once the fabric is idle."""
    from omnifabric.tools.load import run as load

    if args.warmup_seconds > 0:
        say("L1", f"warm-up: {args.sessions} sessions x {args.warmup_seconds} s")
        await load(url, args.sessions, args.warmup_seconds)
    await wait_until(lambda: fabric_idle(stack), args.settle)
    before = await asyncio.to_thread(process_figures, stack)
    say("L1", f"before: {_brief(before)}")
    return before


async def _l1_load(
    args: argparse.Namespace, stack: Stack, url: str, edge_rss: list[float]
) -> tuple[dict[str, Any], dict[str, float]]:
    """N sessions x S s with progress lines (the edge's RSS of each goes into `edge_rss`);
    returns tools.load's figures and the cores this stack and other processes took."""
    from omnifabric.tools.load import run as load

    edge = http_address(stack.url)

    def line() -> str:
        samples = scrape(edge)
        edge_rss.append(round(metric(samples, "process_resident_memory_bytes") / 2**20, 1))
        return (
            f"{metric(samples, 'omni_edge_sessions_active', state='active'):.0f} sessions "
            f"active, {metric(samples, 'omni_edge_outputs_total'):.0f} results so far; "
            f"edge RSS {edge_rss[-1]:.0f} MiB"
        )

    say("L1", f"{args.sessions} sessions x {args.seconds} s at 1 unit/s")
    pids = [os.getpid(), *(svc.proc.pid for svc in stack.services)]
    cpu_before, started = cpu_seconds(pids), time.monotonic()
    progress = asyncio.create_task(print_progress("L1", args.progress_every, line))
    try:
        result = await load(url, args.sessions, args.seconds)
    finally:
        progress.cancel()
    cpu_after, wall = cpu_seconds(pids), time.monotonic() - started
    cpu = {
        "ours_cores": round((cpu_after[1] - cpu_before[1]) / wall, 2),
        "others_cores": round(
            ((cpu_after[0] - cpu_before[0]) - (cpu_after[1] - cpu_before[1])) / wall, 2
        ),
    }
    say(
        "L1",
        f"CPU: this stack {cpu['ours_cores']} cores, other processes {cpu['others_cores']}",
    )
    return result, cpu


async def _l1_recover(
    args: argparse.Namespace, stack: Stack, before: Figures
) -> tuple[bool, Figures]:
    """Wait for the fabric to go idle and the tasks and fds to come back to `before`;
    returns whether it went idle and the figures after."""
    idle = await wait_until(lambda: fabric_idle(stack), args.settle)

    def recovered() -> bool:
        now = process_figures(stack)
        return all(
            now[n]["tasks"] <= before[n]["tasks"] and now[n]["fds"] <= before[n]["fds"]
            for n in before
        )

    await wait_until(recovered, args.settle)
    after = await asyncio.to_thread(process_figures, stack)
    say("L1", f"after: {_brief(after)}")
    return idle, after


def _l1_verdict(args: argparse.Namespace, target: str, run: L1Run) -> RowResult:
    """L1's checks and figures from its steps."""
    before, after, result, cpu = run.before, run.after, run.result, run.cpu
    growth = {
        n: round(100.0 * (after[n]["rss_mib"] - before[n]["rss_mib"]) / before[n]["rss_mib"], 2)
        for n in before
    }
    lost_sessions = result["sessions"] - result["closed_ok"]
    overhead = result["overhead_ms"]
    checks = {
        "no lost units": result["lost"] == 0,
        "every session closed": lost_sessions == 0,
        "overhead p99": overhead["p99"] <= args.max_overhead_p99_ms,
        "idle after": run.idle,
        "tasks back": all(after[n]["tasks"] <= before[n]["tasks"] for n in before),
        "fds back": all(after[n]["fds"] <= before[n]["fds"] for n in before),
        "rss growth": all(g < args.max_rss_growth for g in growth.values()),
    }
    figure = (
        f"{result['units_sent']} units, lost {result['lost']}, lost sessions {lost_sessions}, "
        f"dropped {result['dropped']}; overhead p50 {overhead['p50']:.1f} / p95 "
        f"{overhead['p95']:.1f} / p99 {overhead['p99']:.1f} ms; max RSS growth "
        f"{max(growth.values()):+.1f}%; tasks {_delta(before, after, 'tasks')}; "
        f"fds {_delta(before, after, 'fds')}; CPU ours {cpu['ours_cores']}, others "
        f"{cpu['others_cores']} cores"
    )
    return checked(
        "L1",
        checks,
        figure,
        target,
        load=result,
        before=before,
        after=after,
        rss_growth_pct=growth,
        edge_rss_mib_during=run.edge_rss,
        cpu=cpu,
        config={
            key: getattr(args, key)
            for key in ("sessions", "seconds", "workers", "slots", "compute_ms", "warmup_seconds")
        },
    )


def _brief(figures: dict[str, dict[str, float]]) -> str:
    return "; ".join(
        f"{n} {f['rss_mib']:.0f} MiB {f['fds']:.0f} fds {f['tasks']:.0f} tasks"
        for n, f in figures.items()
    )


def _delta(before: dict, after: dict, key: str) -> str:
    """The largest change of `key` over the services, signed."""
    change = max((after[n][key] - before[n][key] for n in before), key=abs)
    return f"{change:+.0f} at most"


async def row_l2(args: argparse.Namespace, log_dir: Path) -> RowResult:
    """L2: one silent session until the worker's audio limit ends it."""
    from omnifabric.tools.client import SILENCE_UNIT, run_session

    limit = args.l2_seconds
    target = f"closed with timeout exactly once at the {limit:g} s audio limit"
    stack = row_stack(log_dir, "L2")
    times: dict[str, float] = {}
    answered = 0

    def on_event(event: dict, _report: Any) -> None:
        nonlocal answered
        kind = event.get("type")
        if kind in ("session.created", "session.closed"):
            times.setdefault(kind, time.monotonic())
        elif kind == "response.output.delta" and event.get("kind") in ("listen", "audio"):
            answered += 1

    try:
        say("L2", f"starting scheduler, one worker with --audio-limit-s {limit:g}, edge")
        stack.start_scheduler()
        worker = stack.start_worker("--audio-limit-s", str(limit), name="w0")
        stack.start_edge()
        # Silence: listening units add the fewest context tokens, so the session meets
        # its time limit before the 8192-token context does (13 tokens per unit).
        units = [SILENCE_UNIT] * (int(limit) + 10)
        say("L2", f"one session, 1 unit/s, for up to {len(units)} s")
        progress = asyncio.create_task(
            print_progress(
                "L2", max(args.progress_every, limit / 10), lambda: f"{answered} units answered"
            )
        )
        try:
            report = await run_session(f"{stack.url}?mode=audio", units, on_event=on_event)
        finally:
            progress.cancel()
        edge = await asyncio.to_thread(scrape, http_address(stack.url))
        work = await asyncio.to_thread(scrape, worker.metrics_address())
    finally:
        stack.stop()
    closed_events = sum(e.get("type") == "session.closed" for e in report.events)
    edge_timeouts = metric(edge, "omni_edge_sessions_total", reason="timeout")
    worker_timeouts = metric(work, "omni_worker_sessions_ended_total", reason="timeout")
    served = sum(u.received_at is not None for u in report.units.values())
    close_s = times.get("session.closed", float("nan")) - times.get("session.created", 0.0)
    checks = {
        "reason timeout": report.closed_reason == "timeout",
        "one session.closed": closed_events == 1,
        "edge counted one timeout": edge_timeouts == 1,
        "worker counted one timeout": worker_timeouts == 1,
        "closed at the limit": abs(close_s - limit) <= max(2.0, 0.01 * limit),
    }
    figure = (
        f"closed {report.closed_reason} x{closed_events} (edge {edge_timeouts:.0f}, worker "
        f"{worker_timeouts:.0f}) at {close_s:.1f} s; {served} units served, "
        f"{len(report.lost_units())} sent after the close unanswered"
    )
    return checked(
        "L2",
        checks,
        figure,
        target,
        limit_s=limit,
        closed_reason=report.closed_reason,
        session_closed_events=closed_events,
        edge_timeout_closes=edge_timeouts,
        worker_timeout_closes=worker_timeouts,
        close_after_s=round(close_s, 2),
        units_served=served,
        units_unanswered_at_close=len(report.lost_units()),
    )


async def row_l3(args: argparse.Namespace, log_dir: Path) -> RowResult:
    """L3: speech sessions one after another on one reference worker; its RSS after each."""
    from omnifabric.tools.client import run_session
    from omnifabric.tools.probe import read_wav_16k, split_units

    target = f"worker RSS back to its baseline +/- {args.max_l3_rss_drift:g}%; 0 lost units"
    units = split_units(read_wav_16k(SPEECH_FIXTURE), 4)[: args.l3_units]
    stack = row_stack(log_dir, "L3")
    rss: list[float] = []
    problems: list[str] = []
    try:
        say("L3", "starting scheduler, one reference-engine worker (1 slot), edge")
        stack.start_scheduler()
        worker = stack.start_worker("--engine", "reference", "--slots", "1", name="ref")
        stack.start_edge()
        address = worker.metrics_address()
        url = f"{stack.url}?mode=audio"
        cleanups = metric(scrape(address), "omni_worker_memory_cleanups_total")

        def cleaned(count: int) -> Callable[[], bool]:
            return lambda: (
                metric(scrape(address), "omni_worker_memory_cleanups_total") >= cleanups + count
            )

        say("L3", f"{args.l3_sessions} sessions in a row, {len(units)} units each (lockstep)")
        for i in range(1, args.l3_sessions + 1):
            report = await run_session(url, units, pace_s=0.0)
            if report.closed_reason != "user_stop" or report.lost_units() or report.error:
                problems.append(
                    f"session {i}: closed {report.closed_reason}, lost {report.lost_units()}, "
                    f"error {report.error}"
                )
            # The worker frees the session after session.closed: wait for its cleanup.
            if not await wait_until(cleaned(i), 30, every_s=0.05):
                problems.append(f"session {i}: no memory cleanup within 30 s")
            samples = await asyncio.to_thread(scrape, address)
            rss.append(metric(samples, "process_resident_memory_bytes") / 2**20)
            if i == 1 or i % max(1, args.l3_sessions // 10) == 0 or i == args.l3_sessions:
                say("L3", f"session {i}: worker RSS {rss[-1]:.1f} MiB")
    finally:
        stack.stop()
    baseline, last = rss[0], rss[-1]
    drift = 100.0 * (last - baseline) / baseline
    checks = {
        "rss back to baseline": abs(drift) <= args.max_l3_rss_drift,
        "sessions ok": not problems,
    }
    figure = (
        f"{len(rss)} sessions; RSS baseline {baseline:.1f} MiB (after session 1), last "
        f"{last:.1f} MiB ({drift:+.2f}%), range {min(rss):.1f}-{max(rss):.1f} MiB; "
        f"{len(problems)} bad sessions"
    )
    return checked(
        "L3",
        checks,
        figure,
        target,
        sessions=len(rss),
        units_per_session=len(units),
        rss_mib_after_each_session=[round(v, 2) for v in rss],
        baseline_mib=round(baseline, 2),
        last_mib=round(last, 2),
        drift_pct=round(drift, 3),
        problems=problems,
    )


async def row_fuzz(args: argparse.Namespace, log_dir: Path) -> RowResult:
    """FUZZ: pytest tests/fuzz in a subprocess with OMNI_FUZZ_EXAMPLES set."""
    target = "only documented errors and status codes; servers healthy after"
    env = dict(os.environ, OMNI_FUZZ_EXAMPLES=str(args.fuzz_examples), PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider"]
    command += ["-o", "timeout=0", "tests/fuzz"]
    say("FUZZ", f"{' '.join(command[2:])} with OMNI_FUZZ_EXAMPLES={args.fuzz_examples}")
    proc = await asyncio.create_subprocess_exec(
        *command,
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    async for raw in proc.stdout:
        line = raw.decode(errors="replace").rstrip()
        lines.append(line)
        if line.strip():
            say("FUZZ", line)
    code = await proc.wait()
    (log_dir / "fuzz.log").write_text("\n".join(lines) + "\n")
    summary = next((ln for ln in reversed(lines) if " passed" in ln or " failed" in ln), "")
    servicer = next((ln for ln in lines if "servicer fuzz:" in ln), "")
    servicer = servicer[servicer.find("servicer fuzz:") :]
    return RowResult(
        "FUZZ",
        code == 0,
        f"pytest exit {code}: {summary.strip('= ')}; {servicer}",
        target,
        figures={"exit_code": code, "summary": summary, "servicer_line": servicer},
    )
