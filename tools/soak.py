"""`omnifabric soak`: the long-run rows of RELIABILITY.md, measured on this machine.

Rows (`--rows`, default all):
- L1: N concurrent real-time audio sessions for S seconds on synthetic workers: lost
  units, fabric overhead per unit, and every service's RSS, open fds and asyncio tasks
  (from its /metrics) before and after.
- L2: one session until the worker's audio limit: it closes with `timeout` exactly once.
- L3: sessions one after another on one reference-engine worker: its RSS returns to the
  baseline taken after the first session.
- F1: SIGKILL the worker serving one of two sessions, repeatedly: the victim's client gets
  session.closed{error} in time, the other session goes on, no lease leaks.
- FUZZ: tests/fuzz with OMNI_FUZZ_EXAMPLES (10k) examples.

Each row starts its own services on free ports of 127.0.0.1 (their logs in --log-dir),
prints progress lines, and the command ends with a table; `--json` writes every figure.
Exit status 1 when a row fails. It runs from a source checkout (it uses tests/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ROWS = ("L1", "L2", "L3", "F1", "FUZZ")
SPEECH_FIXTURE = ROOT / "tests" / "fixtures" / "speech" / "question.wav"


@dataclass
class RowResult:
    """One row of the final table, and what goes into the JSON file."""

    row: str
    passed: bool
    figure: str
    target: str
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)


def checked(
    row: str, checks: dict[str, bool], figure: str, target: str, **figures: Any
) -> RowResult:
    """A row that passes when every named check does; the checks go into its figures."""
    return RowResult(
        row, all(checks.values()), figure, target, figures={**figures, "checks": checks}
    )


def say(row: str, text: str) -> None:
    """A progress line."""
    print(f"[{time.strftime('%H:%M:%S')}] {row}: {text}", flush=True)


# ---- the stack and its figures ------------------------------------------------------------


def _stack(log_dir: Path, row: str):
    """A tests.stack.Stack logging under log_dir/row."""
    from tests.stack import Stack

    path = log_dir / row
    path.mkdir(parents=True, exist_ok=True)
    return Stack(path)


def _edge_metrics_address(stack) -> str:
    return stack.url.removeprefix("ws://").split("/", 1)[0]


def _samples(address: str) -> dict:
    from tests.e2e.wsclient import scrape_metrics

    return scrape_metrics(address)


def _value(samples: dict, name: str, **labels: str) -> float:
    from tests.e2e.wsclient import metric

    return metric(samples, name, **labels)


def process_figures(stack) -> dict[str, dict[str, float]]:
    """RSS (MiB), open fds and live asyncio tasks of every running service, by name."""
    addresses = {"edge": _edge_metrics_address(stack)} if stack.edge else {}
    for svc in stack.services:
        if svc.proc.poll() is None and svc.name != "edge":
            addresses[svc.name] = svc.metrics_address()
    figures = {}
    for name, address in addresses.items():
        samples = _samples(address)
        kind = "edge" if name == "edge" else "scheduler" if "scheduler" in name else "worker"
        figures[name] = {
            "rss_mib": round(_value(samples, "process_resident_memory_bytes") / 2**20, 2),
            "fds": _value(samples, "process_open_fds"),
            "tasks": _value(samples, f"omni_{kind}_asyncio_tasks"),
        }
    return figures


def _idle(stack) -> bool:
    """No session open anywhere and no lease occupying a slot."""
    edge = _samples(_edge_metrics_address(stack))
    scheduler = _samples(stack.services[0].metrics_address())
    workers = [_samples(w.metrics_address()) for w in stack.workers if w.proc.poll() is None]
    return (
        _value(edge, "omni_edge_sessions_active") == 0
        and _value(scheduler, "omni_scheduler_leases_occupying") == 0
        and all(_value(w, "omni_worker_sessions_active") == 0 for w in workers)
    )


def cpu_seconds(pids: list[int]) -> tuple[float, float]:
    """(CPU seconds the whole machine was busy, CPU seconds of `pids`) since boot, from
    /proc: the difference over a run is the load of processes not ours."""
    from omnifabric.tools.bench import machine_busy_s, proc_sample

    ours = 0.0
    for pid in pids:
        sample = proc_sample(pid)
        if sample is not None:
            ours += sample[0]
    return machine_busy_s()[0], ours


async def wait_until(check: Callable[[], bool], timeout_s: float, every_s: float = 0.25) -> bool:
    """Poll a blocking check off the loop until it holds; False at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        if await asyncio.to_thread(check):
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(every_s)


async def _progress(row: str, every_s: float, line: Callable[[], str]) -> None:
    """Print `line()` every `every_s` seconds until cancelled."""
    start = time.monotonic()
    while True:
        await asyncio.sleep(every_s)
        try:
            text = await asyncio.to_thread(line)
        except OSError as exc:
            text = f"(metrics unavailable: {exc})"
        say(row, f"{time.monotonic() - start:.0f} s: {text}")


# ---- L1 -----------------------------------------------------------------------------------


async def row_l1(args: argparse.Namespace, log_dir: Path) -> RowResult:
    """L1: a warm-up round, the baseline, N sessions x S s, then the same figures again."""
    from omnifabric.tools.load import run as load

    target = (
        f"0 lost units and sessions; overhead p99 <= {args.max_overhead_p99_ms:g} ms; tasks "
        f"and fds back to their level; RSS growth < {args.max_rss_growth:g}%"
    )
    stack = _stack(log_dir, "L1")
    try:
        say("L1", f"starting scheduler, {args.workers} workers x {args.slots} slots, edge")
        stack.start_scheduler()
        for i in range(args.workers):
            stack.start_worker(
                "--slots", str(args.slots), "--compute-ms", str(args.compute_ms), name=f"w{i}"
            )
        stack.start_edge()
        url = f"{stack.url}?mode=audio"
        if args.warmup_seconds > 0:
            say("L1", f"warm-up: {args.sessions} sessions x {args.warmup_seconds} s")
            await load(url, args.sessions, args.warmup_seconds)
        await wait_until(lambda: _idle(stack), args.settle)
        before = await asyncio.to_thread(process_figures, stack)
        say("L1", f"before: {_brief(before)}")
        edge = _edge_metrics_address(stack)
        edge_rss: list[float] = []  # MiB, one per progress line: plateau or steady climb?

        def line() -> str:
            samples = _samples(edge)
            edge_rss.append(round(_value(samples, "process_resident_memory_bytes") / 2**20, 1))
            return (
                f"{_value(samples, 'omni_edge_sessions_active', state='active'):.0f} sessions "
                f"active, {_value(samples, 'omni_edge_outputs_total'):.0f} results so far; "
                f"edge RSS {edge_rss[-1]:.0f} MiB"
            )

        say("L1", f"{args.sessions} sessions x {args.seconds} s at 1 unit/s")
        pids = [os.getpid(), *(svc.proc.pid for svc in stack.services)]
        cpu_before, started = cpu_seconds(pids), time.monotonic()
        progress = asyncio.create_task(_progress("L1", args.progress_every, line))
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
        idle = await wait_until(lambda: _idle(stack), args.settle)

        def recovered() -> bool:
            now = process_figures(stack)
            return all(
                now[n]["tasks"] <= before[n]["tasks"] and now[n]["fds"] <= before[n]["fds"]
                for n in before
            )

        await wait_until(recovered, args.settle)
        after = await asyncio.to_thread(process_figures, stack)
        say("L1", f"after: {_brief(after)}")
    finally:
        stack.stop()
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
        "idle after": idle,
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
        edge_rss_mib_during=edge_rss,
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


# ---- L2 -----------------------------------------------------------------------------------


async def row_l2(args: argparse.Namespace, log_dir: Path) -> RowResult:
    """L2: one silent session until the worker's audio limit ends it."""
    from omnifabric.tools.client import SILENCE_UNIT, run_session

    limit = args.l2_seconds
    target = f"closed with timeout exactly once at the {limit:g} s audio limit"
    stack = _stack(log_dir, "L2")
    times: dict[str, float] = {}
    answered = 0

    def on_event(event: dict, _report) -> None:
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
            _progress(
                "L2", max(args.progress_every, limit / 10), lambda: f"{answered} units answered"
            )
        )
        try:
            report = await run_session(f"{stack.url}?mode=audio", units, on_event=on_event)
        finally:
            progress.cancel()
        edge = await asyncio.to_thread(_samples, _edge_metrics_address(stack))
        work = await asyncio.to_thread(_samples, worker.metrics_address())
    finally:
        stack.stop()
    closed_events = sum(e.get("type") == "session.closed" for e in report.events)
    edge_timeouts = _value(edge, "omni_edge_sessions_total", reason="timeout")
    worker_timeouts = _value(work, "omni_worker_sessions_ended_total", reason="timeout")
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


# ---- L3 -----------------------------------------------------------------------------------


async def row_l3(args: argparse.Namespace, log_dir: Path) -> RowResult:
    """L3: speech sessions one after another on one reference worker; its RSS after each."""
    from omnifabric.tools.client import run_session
    from omnifabric.tools.probe import read_wav_16k, split_units

    target = f"worker RSS back to its baseline +/- {args.max_l3_rss_drift:g}%; 0 lost units"
    units = split_units(read_wav_16k(SPEECH_FIXTURE), 4)[: args.l3_units]
    stack = _stack(log_dir, "L3")
    rss: list[float] = []
    problems: list[str] = []
    try:
        say("L3", "starting scheduler, one reference-engine worker (1 slot), edge")
        stack.start_scheduler()
        worker = stack.start_worker("--engine", "reference", "--slots", "1", name="ref")
        stack.start_edge()
        address = worker.metrics_address()
        url = f"{stack.url}?mode=audio"
        cleanups = _value(_samples(address), "omni_worker_memory_cleanups_total")

        def cleaned(count: int) -> Callable[[], bool]:
            return lambda: (
                _value(_samples(address), "omni_worker_memory_cleanups_total") >= cleanups + count
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
            samples = await asyncio.to_thread(_samples, address)
            rss.append(_value(samples, "process_resident_memory_bytes") / 2**20)
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


# ---- F1 -----------------------------------------------------------------------------------


class DrivenSession:
    """A client session fed a silent unit every `pace_s`, its events timestamped."""

    def __init__(self, client, pace_s: float) -> None:
        self.client = client
        self.pace_s = pace_s
        self.events: list[tuple[float, dict]] = []
        self.closed = asyncio.Event()
        self.session_id = ""
        self._tasks: list[asyncio.Task] = []

    @classmethod
    async def open(cls, url: str, pace_s: float) -> DrivenSession:
        """Connect, wait for the lease, init, and start feeding units."""
        from tests.e2e.wsclient import WsClient

        client = await WsClient.open(url)
        WsClient.opened.remove(client)  # ours to close, not a test's
        session = cls(client, pace_s)
        session.session_id = (await client.start())["session_id"]
        session._tasks = [
            asyncio.create_task(session._read()),
            asyncio.create_task(session._feed()),
        ]
        return session

    def results_since(self, t: float) -> int:
        """Results (output deltas) received at or after monotonic time `t`."""
        return sum(1 for at, e in self.events if at >= t and e["type"] == "response.output.delta")

    def bad_events(self) -> list[dict]:
        """Errors and closes received so far."""
        return [e for _, e in self.events if e["type"] in ("error", "session.closed")]

    async def _read(self) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            while True:
                event = await self.client.recv(timeout_s=60)
                self.events.append((time.monotonic(), event))
                if event["type"] == "session.closed":
                    return
        except (ConnectionClosed, TimeoutError):
            pass
        finally:
            self.closed.set()

    async def _feed(self) -> None:
        from tests.e2e.wsclient import SILENCE

        while not self.closed.is_set():
            try:
                await self.client.append(SILENCE)
            except Exception:  # the connection is gone: the reader reports it
                return
            await asyncio.sleep(self.pace_s)

    async def close(self) -> dict | None:
        """session.close, then the session.closed event (None when none came)."""
        try:
            await self.client.send({"type": "session.close"})
            await asyncio.wait_for(self.closed.wait(), 10)
        except Exception:
            pass
        await self.shutdown()
        return next((e for _, e in self.events if e["type"] == "session.closed"), None)

    async def shutdown(self) -> None:
        """Stop feeding and reading; close the connection."""
        for task in self._tasks:
            task.cancel()
        await self.client.ws.close()


async def row_f1(args: argparse.Namespace, log_dir: Path) -> RowResult:
    """F1: two sessions on two workers, SIGKILL one worker, restart it; repeated."""
    import grpc

    from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
    from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc
    from omnifabric.tools import faults
    from omnifabric.tools.client import percentile

    limit = args.f1_close_limit
    target = (
        f"victim closed with error within {limit:g} s every time; the other session "
        f"untouched; 0 leaked leases"
    )
    stack = _stack(log_dir, "F1")
    closes: list[float] = []
    reasons: list[str] = []
    leaked: list[int] = []
    disturbed: list[int] = []
    try:
        say("F1", "starting scheduler, edge, two workers with 1 slot each")
        stack.start_scheduler()
        workers = {name: stack.start_worker("--slots", "1", name=name) for name in ("fa", "fb")}
        stack.start_edge()
        url = f"{stack.url}?mode=audio"
        channel = grpc.aio.insecure_channel(stack.scheduler_address)
        scheduler = scheduler_grpc.SchedulerServiceStub(channel)

        async def status() -> scheduler_pb.GetStatusResponse:
            return await scheduler.GetStatus(scheduler_pb.GetStatusRequest(), timeout=5)

        async def settled(sessions_open: int, free: int) -> scheduler_pb.GetStatusResponse:
            """The scheduler's snapshot once it matches (or after 5 s, as it is)."""
            deadline = time.monotonic() + 5
            while True:
                snap = await status()
                ok = len(snap.workers) == 2 and snap.leases_active == sessions_open
                if ok and sum(w.slots_free for w in snap.workers) == free:
                    return snap
                if time.monotonic() > deadline:
                    return snap
                await asyncio.sleep(0.05)

        for rep in range(1, args.f1_repeats + 1):
            victim = await DrivenSession.open(url, args.f1_pace)
            other = await DrivenSession.open(url, args.f1_pace)
            serving = await asyncio.to_thread(_session_workers, stack)
            name = serving.get(victim.session_id)
            if name not in workers or serving.get(other.session_id) == name:
                raise RuntimeError(f"repetition {rep}: sessions not on two workers: {serving}")
            await _results(other, 1)
            faults.kill(workers[name].proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            try:
                await asyncio.wait_for(victim.closed.wait(), 30)
                closes.append(time.monotonic() - killed)
            except TimeoutError:
                closes.append(float("inf"))
            closed = next((e for _, e in victim.events if e["type"] == "session.closed"), {})
            reasons.append(str(closed.get("reason")))
            await victim.shutdown()
            # The other session goes on: two more results, no error, no close.
            bad = 0 if await _results(other, 2, since=killed) else 1
            await asyncio.to_thread(workers[name].proc.wait, 10)
            workers[name] = await asyncio.to_thread(stack.start_worker, "--slots", "1", name=name)
            mid = await settled(1, 1)
            bad += len(other.bad_events())
            closed_other = await other.close()
            if closed_other is None or closed_other.get("reason") != "user_stop":
                bad += 1
            end = await settled(0, 2)
            # Leases beyond the open sessions, or slots still held, at either point.
            leaked.append(
                max(
                    0,
                    mid.leases_active - 1,
                    1 - sum(w.slots_free for w in mid.workers),
                    end.leases_active,
                    2 - sum(w.slots_free for w in end.workers),
                )
            )
            disturbed.append(bad)
            say(
                "F1",
                f"{rep}/{args.f1_repeats}: killed {name}, victim closed "
                f"{reasons[-1]} in {closes[-1] * 1000:.0f} ms; other session "
                f"{'untouched' if not bad else 'DISTURBED'}; leaked leases {leaked[-1]}",
            )
        await channel.close()
    finally:
        stack.stop()
    checks = {
        "closed in time": bool(closes) and max(closes) <= limit,
        "reason error": all(r == "error" for r in reasons),
        "other untouched": not any(disturbed),
        "no leaked lease": not any(leaked),
    }
    figure = (
        f"{len(closes)} kills: close p50 {percentile(closes, 50) * 1000:.0f} ms, max "
        f"{max(closes) * 1000:.0f} ms, reasons {sorted(set(reasons))}; other session "
        f"disturbed {sum(1 for d in disturbed if d)}x; leaked leases {sum(leaked)}"
    )
    return checked(
        "F1",
        checks,
        figure,
        target,
        repeats=len(closes),
        close_s=[round(c, 4) for c in closes],
        close_p50_s=round(percentile(closes, 50), 4),
        close_max_s=round(max(closes), 4),
        reasons=reasons,
        leaked_leases=sum(leaked),
        other_session_disturbed=sum(1 for d in disturbed if d),
    )


def _session_workers(stack) -> dict[str, str]:
    """session id -> worker id, from the edge's GET /status."""
    with urllib.request.urlopen(f"http://{_edge_metrics_address(stack)}/status", timeout=5) as r:
        body = json.loads(r.read())
    return {s["session_id"]: s["worker_id"] for s in body["sessions"]}


async def _results(session: DrivenSession, count: int, since: float = 0.0) -> bool:
    """Wait until the session has `count` results after `since` (10 s at most)."""
    deadline = time.monotonic() + 10
    while session.results_since(since) < count:
        if session.closed.is_set() or time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


# ---- FUZZ ---------------------------------------------------------------------------------


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


RUNNERS: dict[str, Callable[[argparse.Namespace, Path], Awaitable[RowResult]]] = {
    "L1": row_l1,
    "L2": row_l2,
    "L3": row_l3,
    "F1": row_f1,
    "FUZZ": row_fuzz,
}


# ---- command ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The flags of `omnifabric soak`: rows, and a short form for each row's size."""
    parser = argparse.ArgumentParser(prog="omnifabric soak", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows to run")
    parser.add_argument("--json", type=Path, help="write every figure to this JSON file")
    parser.add_argument("--log-dir", type=Path, help="service logs (default: a temp folder)")
    parser.add_argument(
        "--progress-every", type=float, default=10.0, help="seconds between progress lines"
    )
    parser.add_argument(
        "--settle", type=float, default=15.0, help="max wait for the fabric to go idle, s"
    )
    l1 = parser.add_argument_group("L1")
    l1.add_argument("--sessions", type=int, default=100, help="concurrent sessions")
    l1.add_argument("--seconds", type=int, default=120, help="units (seconds) per session")
    l1.add_argument("--workers", type=int, default=4)
    l1.add_argument("--slots", type=int, default=25, help="slots per worker")
    l1.add_argument("--compute-ms", type=float, default=40.0, help="synthetic compute per unit")
    l1.add_argument(
        "--warmup-seconds",
        type=int,
        default=30,
        help="a first round of the same sessions, so that the baseline is the processes' "
        "steady state rather than a cold start (0 = none)",
    )
    l1.add_argument("--max-overhead-p99-ms", type=float, default=20.0)
    l1.add_argument("--max-rss-growth", type=float, default=10.0, help="percent per service")
    l2 = parser.add_argument_group("L2")
    l2.add_argument("--l2-seconds", type=float, default=600.0, help="the worker's audio limit")
    l3 = parser.add_argument_group("L3")
    l3.add_argument("--l3-sessions", type=int, default=100)
    l3.add_argument("--l3-units", type=int, default=8, help="units of the speech fixture each")
    l3.add_argument("--max-l3-rss-drift", type=float, default=5.0, help="percent")
    f1 = parser.add_argument_group("F1")
    f1.add_argument("--f1-repeats", type=int, default=50)
    f1.add_argument("--f1-close-limit", type=float, default=2.0, help="seconds")
    f1.add_argument("--f1-pace", type=float, default=0.25, help="seconds between units")
    fuzz = parser.add_argument_group("FUZZ")
    fuzz.add_argument("--fuzz-examples", type=int, default=10_000)
    return parser


async def run(args: argparse.Namespace, rows: list[str], log_dir: Path) -> list[RowResult]:
    """Run the rows in order; a row that raises is a FAIL with the error as its figure."""
    results = []
    for row in rows:
        started = time.monotonic()
        say(row, "start")
        try:
            result = await RUNNERS[row](args, log_dir)
        except Exception as exc:  # noqa: BLE001 - reported as the row's failure
            result = RowResult(row, False, f"error: {type(exc).__name__}: {exc}", "-")
        result.seconds = round(time.monotonic() - started, 1)
        say(row, f"{'PASS' if result.passed else 'FAIL'} in {result.seconds:.0f} s")
        results.append(result)
    return results


def table(results: list[RowResult]) -> str:
    """The per-row table: row, figure, target, PASS/FAIL."""
    lines = ["row   result  time     figure", "      target"]
    for r in results:
        lines.append(
            f"{r.row:5s} {'PASS' if r.passed else 'FAIL':6s}  {r.seconds:6.0f}s  {r.figure}"
        )
        lines.append(f"      target: {r.target}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `omnifabric soak`; 0 when every row passes."""
    args = build_parser().parse_args(argv)
    rows = [r.strip().upper() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in RUNNERS]
    if unknown or not rows:
        print(f"omnifabric soak: unknown rows {unknown}; choose from {ROWS}", file=sys.stderr)
        return 2
    if not (ROOT / "tests" / "stack.py").exists():
        print("omnifabric soak: run it from a source checkout (it needs tests/)", file=sys.stderr)
        return 2
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="omnifabric-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"omnifabric soak: rows {','.join(rows)}; service logs in {log_dir}", flush=True)
    try:
        import uvloop
    except ImportError:
        results = asyncio.run(run(args, rows, log_dir))
    else:
        results = uvloop.run(run(args, rows, log_dir))
    print()
    print(table(results))
    passed = all(r.passed for r in results)
    if args.json:
        body = {
            "command": ["omnifabric", "soak", *(sys.argv[1:] if argv is None else argv)],
            "pass": passed,
            "rows": [asdict(r) for r in results],
        }
        args.json.write_text(json.dumps(body, indent=2, default=str) + "\n")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
