"""The F1 row of `omnifabric soak`: SIGKILL the worker serving one of two sessions,
repeatedly; the victim's client must get session.closed{error} in time, the other session
go on, and no lease leak."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnifabric.tools.client import SILENCE_UNIT
from omnifabric.tools.perf.console import say
from omnifabric.tools.perf.metrics import http_address
from omnifabric.tools.perf.soak_row import TIME_FACTOR, RowResult, checked, row_stack
from omnifabric.tools.perf.stack import Service, Stack
from omnifabric.tools.perf.wsclient import WsClient

if TYPE_CHECKING:
    from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb


class DrivenSession:
    """A client session fed a silent unit every `pace_s`, its events timestamped."""

    def __init__(self, client: WsClient, pace_s: float) -> None:
        self.client = client
        self.pace_s = pace_s
        self.events: list[tuple[float, dict]] = []
        self.closed = asyncio.Event()
        self.session_id = ""
        self._tasks: list[asyncio.Task] = []

    @classmethod
    async def open(cls, url: str, pace_s: float) -> DrivenSession:
        """Connect, wait for the lease, init, and start feeding units."""
        client = await WsClient.open(url)
        client.time_factor = TIME_FACTOR
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
        while not self.closed.is_set():
            try:
                await self.client.append(SILENCE_UNIT)
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


@dataclass
class F1Tally:
    """F1's figures, one entry per repetition."""

    closes: list[float] = field(default_factory=list)
    """Seconds from the kill to the victim's close (inf: none within 30 s)."""
    reasons: list[str] = field(default_factory=list)
    """The victim's session.closed reason ("None" without one)."""
    leaked: list[int] = field(default_factory=list)
    disturbed: list[int] = field(default_factory=list)
    """What went wrong with the other session: missed results, errors, a bad close."""


class SchedulerView:
    """The scheduler's GetStatus, as F1 reads it between kills."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    async def status(self) -> scheduler_pb.GetStatusResponse:
        from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb

        return await self.scheduler.GetStatus(scheduler_pb.GetStatusRequest(), timeout=5)

    async def settled(self, sessions_open: int, free: int) -> scheduler_pb.GetStatusResponse:
        """The scheduler's snapshot once it matches (or after 5 s, as it is)."""
        deadline = time.monotonic() + 5
        while True:
            snap = await self.status()
            ok = len(snap.workers) == 2 and snap.leases_active == sessions_open
            if ok and sum(w.slots_free for w in snap.workers) == free:
                return snap
            if time.monotonic() > deadline:
                return snap
            await asyncio.sleep(0.05)


async def row_f1(args: argparse.Namespace, log_dir: Path) -> RowResult:
    """F1: two sessions on two workers, SIGKILL one worker, restart it; repeated."""
    limit = args.f1_close_limit
    target = (
        f"victim closed with error within {limit:g} s every time; the other session "
        f"untouched; 0 leaked leases"
    )
    stack = row_stack(log_dir, "F1")
    tally = F1Tally()
    try:
        await _f1_run(args, stack, tally)
    finally:
        stack.stop()
    return _f1_result(tally, limit, target)


async def _f1_run(args: argparse.Namespace, stack: Stack, tally: F1Tally) -> None:
    """Start F1's stack (a scheduler, an edge, two 1-slot workers), then repeat the kill."""
    import grpc

    from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc

    say("F1", "starting scheduler, edge, two workers with 1 slot each")
    stack.start_scheduler()
    workers = {name: stack.start_worker("--slots", "1", name=name) for name in ("fa", "fb")}
    stack.start_edge()
    url = f"{stack.url}?mode=audio"
    channel = grpc.aio.insecure_channel(stack.scheduler_address)
    scheduler = SchedulerView(scheduler_grpc.SchedulerServiceStub(channel))
    for rep in range(1, args.f1_repeats + 1):
        await _f1_repetition(rep, args, stack, workers, url, scheduler, tally)
    await channel.close()


async def _f1_repetition(
    rep: int,
    args: argparse.Namespace,
    stack: Stack,
    workers: dict[str, Service],
    url: str,
    scheduler: SchedulerView,
    tally: F1Tally,
) -> None:
    """One repetition: open two sessions on the two workers, kill the victim's worker, see
    both sessions through and restart the worker; its figures go into `tally`."""
    victim = await DrivenSession.open(url, args.f1_pace)
    other = await DrivenSession.open(url, args.f1_pace)
    serving = await asyncio.to_thread(_session_workers, stack)
    name = serving.get(victim.session_id)
    if name not in workers or serving.get(other.session_id) == name:
        raise RuntimeError(f"repetition {rep}: sessions not on two workers: {serving}")
    await _results(other, 1)
    killed = await _kill_victim(workers[name], victim, tally)
    # The other session goes on: two more results, no error, no close.
    bad = 0 if await _results(other, 2, since=killed) else 1
    await asyncio.to_thread(workers[name].proc.wait, 10)
    workers[name] = await asyncio.to_thread(stack.start_worker, "--slots", "1", name=name)
    mid = await scheduler.settled(1, 1)
    bad += len(other.bad_events())
    closed_other = await other.close()
    if closed_other is None or closed_other.get("reason") != "user_stop":
        bad += 1
    end = await scheduler.settled(0, 2)
    # Leases beyond the open sessions, or slots still held, at either point.
    tally.leaked.append(
        max(
            0,
            mid.leases_active - 1,
            1 - sum(w.slots_free for w in mid.workers),
            end.leases_active,
            2 - sum(w.slots_free for w in end.workers),
        )
    )
    tally.disturbed.append(bad)
    say(
        "F1",
        f"{rep}/{args.f1_repeats}: killed {name}, victim closed "
        f"{tally.reasons[-1]} in {tally.closes[-1] * 1000:.0f} ms; other session "
        f"{'untouched' if not bad else 'DISTURBED'}; leaked leases {tally.leaked[-1]}",
    )


async def _kill_victim(worker: Service, victim: DrivenSession, tally: F1Tally) -> float:
    """SIGKILL the victim's worker and wait (30 s at most) for the victim's close: its time
    and reason go into `tally`. Returns when the kill was sent (monotonic)."""
    from omnifabric.tools import faults

    faults.kill(worker.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    try:
        await asyncio.wait_for(victim.closed.wait(), 30)
        tally.closes.append(time.monotonic() - killed)
    except TimeoutError:
        tally.closes.append(float("inf"))
    closed = next((e for _, e in victim.events if e["type"] == "session.closed"), {})
    tally.reasons.append(str(closed.get("reason")))
    await victim.shutdown()
    return killed


def _f1_result(tally: F1Tally, limit: float, target: str) -> RowResult:
    """F1's checks and figures from its repetitions."""
    from omnifabric.common.stats import percentile

    closes, reasons, leaked, disturbed = tally.closes, tally.reasons, tally.leaked, tally.disturbed
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


def _session_workers(stack: Stack) -> dict[str, str]:
    """session id -> worker id, from the edge's GET /status."""
    with urllib.request.urlopen(f"http://{http_address(stack.url)}/status", timeout=5) as r:
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
