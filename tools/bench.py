"""`omnifabric bench`: fabric overhead per unit against two baselines measured in the same run.

For each session count N (`--sessions 1,10,50,100`), N concurrent real-time audio sessions
send one 1 s unit per second for S seconds over three paths on this machine:

- **fabric**: the public WebSocket protocol through edge, scheduler and worker (a stack
  this command starts: synthetic engine with `--compute-ms`, or `--url` of a running edge);
- **ws-echo**: a raw websockets server (uvloop, own process) echoing the same JSON frames;
- **grpc-direct**: a lease from the scheduler, then WorkerService.Session straight to the
  worker with the same PCM (no edge, no JSON; the scheduler is not on the unit path).

Overhead per unit = client send to client receive minus the engine's reported compute
(prefill + generate; zero for the echo). Reported per path and count: p50/p95/p99/max,
lost units (no result and no counted drop; also sessions without a close), dropped units,
queue waits, CPU and peak RSS of every process, the edge's CPU microseconds per unit, and
the ratios fabric / baseline. `--find-max` then searches the largest count whose fabric
p99 stays within `--max-p99-ms` with nothing lost. Output: bench.json, bench.md and
bench.png (overhead percentiles against session count) in `--out`; progress lines while
it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from omnifabric.tools.client import percentile

PATHS = ("fabric", "ws-echo", "grpc-direct")
RESULT_TYPES = ("response.output.delta", "response.listen", "response.output_audio.delta")


def say(text: str) -> None:
    """A progress line."""
    print(f"[{time.strftime('%H:%M:%S')}] bench: {text}", flush=True)


# ---- processes: CPU and memory from /proc -------------------------------------------------


def proc_sample(pid: int) -> tuple[float, float] | None:
    """(CPU seconds used so far, RSS MiB) of a live process, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/statm") as statm:
            pages = int(statm.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return cpu, pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def machine_busy_s() -> tuple[float, float]:
    """CPU seconds the whole machine has been busy since boot (all cores), and of those the
    steal (a virtual machine's cores taken by its host)."""
    with open("/proc/stat") as stat:
        ticks = [int(v) for v in stat.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    steal = ticks[7] if len(ticks) > 7 else 0
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / hz, steal / hz


class ProcessWatch:
    """Samples CPU time and RSS of named processes every `every_s` while a level runs."""

    def __init__(self, pids: dict[str, int], every_s: float = 0.5) -> None:
        self.pids = pids
        self.every_s = every_s
        self.first: dict[str, tuple[float, float]] = {}
        self.last: dict[str, tuple[float, float]] = {}
        self.peak_rss: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._t0 = 0.0
        self._busy0 = (0.0, 0.0)
        self.wall_s = 0.0
        self.machine_cores = 0.0
        self.steal_cores = 0.0

    def _sample(self) -> None:
        for name, pid in self.pids.items():
            sample = proc_sample(pid)
            if sample is None:
                continue
            self.first.setdefault(name, sample)
            self.last[name] = sample
            self.peak_rss[name] = max(self.peak_rss.get(name, 0.0), sample[1])

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            self._sample()

    def start(self) -> None:
        self._t0, self._busy0 = time.monotonic(), machine_busy_s()
        self._sample()
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> dict[str, dict[str, float]]:
        """Per process: CPU seconds and cores over the level, peak and last RSS (MiB)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._sample()
        self.wall_s = max(1e-9, time.monotonic() - self._t0)
        busy, steal = machine_busy_s()
        self.machine_cores = (busy - self._busy0[0]) / self.wall_s
        self.steal_cores = (steal - self._busy0[1]) / self.wall_s
        out = {}
        for name in self.last:
            cpu_s = self.last[name][0] - self.first[name][0]
            out[name] = {
                "cpu_s": round(cpu_s, 3),
                "cores": round(cpu_s / self.wall_s, 3),
                "rss_mib_peak": round(self.peak_rss[name], 1),
                "rss_mib_end": round(self.last[name][1], 1),
            }
        return out


# ---- what one level of one path measured --------------------------------------------------


@dataclass
class Level:
    """N sessions x S seconds over one path."""

    path: str
    sessions: int
    seconds: int
    units_sent: int = 0
    answered: int = 0
    lost: int = 0
    dropped: int = 0
    lost_sessions: int = 0
    errors: list[str] = field(default_factory=list)
    overhead_ms: dict[str, float] = field(default_factory=dict)
    overhead_streaming_ms: dict[str, float] = field(default_factory=dict)
    """Units sent while every session streams (session opens and closes left out)."""
    rtt_ms: dict[str, float] = field(default_factory=dict)
    engine_ms: dict[str, float] = field(default_factory=dict)
    queue_wait_ms: dict[str, float] = field(default_factory=dict)
    in_worker_ms: dict[str, float] = field(default_factory=dict)
    """The part of the overhead spent inside the worker (its wall clock minus compute)."""
    client_loop_lag_ms: dict[str, float] = field(default_factory=dict)
    """How late the measuring client's event loop woke up (its own share of the overhead)."""
    processes: dict[str, dict[str, float]] = field(default_factory=dict)
    machine_cores: float = 0.0
    """Cores busy on the whole machine during the level (ours, others' and steal)."""
    steal_cores: float = 0.0
    noisy_attempts: list[dict[str, Any]] = field(default_factory=list)
    """Earlier attempts of this level set aside for steal above --max-steal."""
    wall_s: float = 0.0
    edge_cpu_us_per_unit: float | None = None
    """Edge CPU over the whole level (session opens and closes included) per answered unit."""
    edge_cpu_us_per_unit_steady: float | None = None
    """The same while every session streams (after the last open, before the first close)."""

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.lost_sessions == 0 and self.answered > 0


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": math.nan, "p95": math.nan, "p99": math.nan, "max": math.nan}
    return {
        "p50": round(percentile(values, 50), 3),
        "p95": round(percentile(values, 95), 3),
        "p99": round(percentile(values, 99), 3),
        "max": round(max(values), 3),
    }


@dataclass
class Samples:
    """Per-unit figures as they arrive (the progress lines read them)."""

    overhead: list[float] = field(default_factory=list)
    rtt: list[float] = field(default_factory=list)
    engine: list[float] = field(default_factory=list)
    queue_wait: list[float] = field(default_factory=list)
    in_worker: list[float] = field(default_factory=list)
    """Worker receive -> result send minus the engine's compute (paths that report it)."""
    sent_at: list[float] = field(default_factory=list)
    """When each answered unit was sent (monotonic), parallel to `overhead`."""
    sent: int = 0
    dropped: int = 0
    lost: int = 0
    lost_sessions: int = 0
    errors: list[str] = field(default_factory=list)

    def answer(
        self, sent_at: float, rtt_ms: float, engine_ms: float, worker_wall_ms: float | None = None
    ) -> None:
        self.sent_at.append(sent_at)
        self.rtt.append(rtt_ms)
        self.engine.append(engine_ms)
        self.overhead.append(rtt_ms - engine_ms)
        if worker_wall_ms is not None:
            self.in_worker.append(worker_wall_ms - engine_ms)

    def fill(self, level: Level) -> Level:
        level.units_sent = self.sent
        level.answered = len(self.overhead)
        level.lost, level.dropped, level.lost_sessions = self.lost, self.dropped, self.lost_sessions
        level.errors = sorted(set(self.errors))[:10]
        level.overhead_ms = _stats(self.overhead)
        level.rtt_ms = _stats(self.rtt)
        level.engine_ms = _stats(self.engine)
        level.queue_wait_ms = _stats(self.queue_wait)
        level.in_worker_ms = _stats(self.in_worker)
        return level


# ---- the units ----------------------------------------------------------------------------


def unit_script(seconds: int) -> list[np.ndarray]:
    """Speech and silence (tools.load's pattern): speak replies are measured as well."""
    from omnifabric.tools.load import script

    return script(seconds)


def _pcm(unit: np.ndarray) -> bytes:
    return unit.astype("<f4").tobytes()


def append_frame(unit: np.ndarray) -> str:
    """The public protocol's append event carrying one unit (what fabric and echo send)."""
    import base64

    return json.dumps(
        {"type": "input.append", "input": {"audio": base64.b64encode(_pcm(unit)).decode()}}
    )


async def _paced(seconds: int, send: Callable[[int], Awaitable[bool]]) -> None:
    """One send a second from now, `seconds` times, until `send` returns False."""
    start = time.monotonic()
    for k in range(seconds):
        delay = start + k - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if not await send(k):
            return


class UnitLedger:
    """One session's units by seq: when each was sent, which got a result, which the
    worker reported dropped. Both result-bearing paths (fabric, grpc-direct) keep one."""

    def __init__(self, samples: Samples) -> None:
        self.samples = samples
        self.sent: dict[int, float] = {}
        self.answered: set[int] = set()
        self.dropped: set[int] = set()

    def send(self, seq: int) -> None:
        self.sent[seq] = time.monotonic()
        self.samples.sent += 1

    def result(
        self,
        seq: int,
        dropped_seqs,
        now: float,
        engine_ms: float,
        worker_wall_ms: float | None,
    ) -> None:
        """A unit's result: its first one counts; the drops it reports are noted first."""
        for gone in dropped_seqs:
            if gone in self.sent and gone not in self.answered:
                self.dropped.add(gone)
        if seq in self.sent and seq not in self.answered and seq not in self.dropped:
            self.answered.add(seq)
            sent_at = self.sent[seq]
            self.samples.answer(sent_at, (now - sent_at) * 1000.0, engine_ms, worker_wall_ms)

    def settled(self) -> bool:
        """Every unit sent has a result or a reported drop."""
        return len(self.answered) + len(self.dropped) >= len(self.sent)

    def tally(self, closed_cleanly: bool) -> None:
        """Add this session's drops, lost units and (unless `closed_cleanly`) itself as lost."""
        s = self.samples
        s.dropped += len(self.dropped)
        s.lost += len(self.sent) - len(self.answered) - len(self.dropped)
        if not closed_cleanly:
            s.lost_sessions += 1


# ---- path: fabric (public WebSocket protocol through the edge) ----------------------------


async def fabric_session(
    url: str, delay_s: float, units: list[np.ndarray], frames: list[str], s: Samples
) -> None:
    """One session over the public protocol, opened after `delay_s`; figures into `s`."""
    from websockets.asyncio.client import connect

    units_by_seq = UnitLedger(s)
    closed = asyncio.Event()
    reason: list[str] = []
    await asyncio.sleep(delay_s)  # opens spread over --ramp-s
    t0 = time.monotonic()
    try:
        async with connect(
            url, subprotocols=["map.realtime"], compression=None, max_size=None, open_timeout=60
        ) as ws:
            while True:
                event = json.loads(await ws.recv())
                if event["type"] == "session.queue_done":
                    s.queue_wait.append((time.monotonic() - t0) * 1000.0)
                    break
                if event["type"] == "error":
                    raise RuntimeError(f"queue: {event['error'].get('code')}")
            await ws.send(json.dumps({"type": "session.init", "payload": {}}))
            event = json.loads(await ws.recv())
            if event["type"] != "session.created":
                raise RuntimeError(f"init: {event.get('error', event['type'])}")

            async def receive() -> None:
                try:
                    async for raw in ws:
                        if not _on_event(json.loads(raw), time.monotonic()):
                            return
                except Exception as exc:
                    s.errors.append(f"receive: {type(exc).__name__}")
                finally:
                    closed.set()

            def _on_event(event: dict[str, Any], now: float) -> bool:
                """Record one server event; False once the session is closed."""
                kind = event.get("type")
                if kind == "session.closed":
                    reason.append(str(event.get("reason")))
                    return False
                if kind == "error":
                    s.errors.append(str(event.get("error", {}).get("code")))
                    return True
                if kind not in RESULT_TYPES:
                    return True
                metrics = event.get("metrics") or {}
                units_by_seq.result(
                    metrics.get("seq"),
                    metrics.get("dropped_seqs", ()),
                    now,
                    metrics.get("prefill_ms", 0.0) + metrics.get("generate_ms", 0.0),
                    metrics.get("wall_clock_ms"),
                )
                return True

            receiver = asyncio.create_task(receive())

            async def send(k: int) -> bool:
                if closed.is_set():
                    return False
                units_by_seq.send(k + 1)
                await ws.send(frames[k])
                return True

            await _paced(len(units), send)
            await _settle(units_by_seq.settled, closed, 5.0)
            if not closed.is_set():
                await ws.send(json.dumps({"type": "session.close", "reason": "user_stop"}))
                await asyncio.wait_for(closed.wait(), 15)
            receiver.cancel()
    except Exception as exc:  # the session is counted lost; the run goes on
        s.errors.append(f"{type(exc).__name__}: {exc}"[:120])
    units_by_seq.tally(closed_cleanly=reason == ["user_stop"])


async def _settle(done: Callable[[], bool], closed: asyncio.Event, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and not closed.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


# ---- path: raw websockets echo ------------------------------------------------------------


def echo_server_main(host: str) -> int:
    """`python -m omnifabric.tools.bench --echo-server HOST`: echo every message back; prints
    `echo ready: ws://HOST:PORT`."""

    async def serve() -> None:
        from websockets.asyncio.server import serve as ws_serve

        async def echo(ws) -> None:
            async for message in ws:
                await ws.send(message)

        async with ws_serve(echo, host, 0, compression=None, max_size=None) as server:
            port = server.sockets[0].getsockname()[1]
            print(f"echo ready: ws://{host}:{port}", flush=True)
            await asyncio.Future()

    _run_loop(serve())
    return 0


async def echo_session(
    url: str, delay_s: float, units: list[np.ndarray], frames: list[str], s: Samples
) -> None:
    """One session of the same frames against the echo server (order preserved: FIFO)."""
    from websockets.asyncio.client import connect

    pending: list[float] = []
    answered = 0
    await asyncio.sleep(delay_s)
    try:
        async with connect(url, compression=None, max_size=None, open_timeout=60) as ws:

            async def receive() -> None:
                nonlocal answered
                async for _ in ws:
                    now = time.monotonic()
                    s.answer(pending[answered], (now - pending[answered]) * 1000.0, 0.0)
                    answered += 1

            receiver = asyncio.create_task(receive())

            async def send(k: int) -> bool:
                pending.append(time.monotonic())
                s.sent += 1
                await ws.send(frames[k])
                return True

            await _paced(len(units), send)
            await _settle(lambda: answered >= len(pending), asyncio.Event(), 5.0)
            receiver.cancel()
    except Exception as exc:
        s.errors.append(f"{type(exc).__name__}: {exc}"[:120])
        s.lost_sessions += 1
    s.lost += len(pending) - answered


# ---- path: gRPC straight to the worker ----------------------------------------------------


class GrpcDirect:
    """Leases from the scheduler, Sessions on the worker's own gRPC port (one channel per
    address, as the edge keeps them)."""

    def __init__(self, scheduler: str) -> None:
        import grpc

        from omnifabric.edge.fabric import channel_options
        from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc

        options = channel_options(16 * 2**20)
        self._grpc = grpc
        self._options = options
        self._sched_channel = grpc.aio.insecure_channel(scheduler, options=options)
        self.scheduler = scheduler_grpc.SchedulerServiceStub(self._sched_channel)
        self._workers: dict[str, Any] = {}

    def worker(self, address: str):
        from omnifabric.omni.realtime.v1 import worker_service_pb2_grpc as worker_grpc

        if address not in self._workers:
            channel = self._grpc.aio.insecure_channel(address, options=self._options)
            self._workers[address] = (channel, worker_grpc.WorkerServiceStub(channel))
        return self._workers[address][1]

    async def close(self) -> None:
        for channel, _ in self._workers.values():
            await channel.close()
        await self._sched_channel.close()

    async def session(
        self, delay_s: float, units: list[np.ndarray], pcms: list[bytes], s: Samples
    ) -> None:
        """One session: Acquire (held open: the lease lives with it), Session, units, close."""
        from omnifabric.omni.realtime.v1 import common_pb2
        from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
        from omnifabric.omni.realtime.v1 import worker_service_pb2 as worker_pb

        await asyncio.sleep(delay_s)
        session_id = f"bench-{uuid.uuid4().hex[:12]}"
        units_by_seq = UnitLedger(s)
        ended: list[int] = []
        acquire = self.scheduler.Acquire(
            scheduler_pb.AcquireRequest(mode=common_pb2.MODE_AUDIO, session_id=session_id)
        )
        t0 = time.monotonic()
        try:
            lease = None
            async for response in acquire:
                if response.WhichOneof("kind") == "lease":
                    lease = response.lease
                    break
                if response.WhichOneof("kind") != "queued":
                    raise RuntimeError(f"acquire: {response.WhichOneof('kind')}")
            if lease is None:
                raise RuntimeError("acquire: ended without a lease")
            s.queue_wait.append((time.monotonic() - t0) * 1000.0)
            requests: asyncio.Queue = asyncio.Queue()
            requests.put_nowait(
                worker_pb.SessionRequest(
                    start=worker_pb.SessionStart(
                        lease_id=lease.lease_id, session_id=session_id, mode=common_pb2.MODE_AUDIO
                    )
                )
            )

            async def outgoing():
                while (request := await requests.get()) is not None:
                    yield request

            call = self.worker(lease.worker_address).Session(outgoing())
            first = await call.read()
            if first is self._grpc.aio.EOF or first.WhichOneof("kind") != "started":
                raise RuntimeError("session: no started")
            done = asyncio.Event()

            async def receive() -> None:
                # read(), not `async for`: grpc.aio refuses both styles on one call.
                while (response := await call.read()) is not self._grpc.aio.EOF:
                    now = time.monotonic()
                    kind = response.WhichOneof("kind")
                    if kind == "ended":
                        ended.append(response.ended.reason)
                        break
                    if kind != "result":
                        continue
                    result, timings = response.result, response.result.timings
                    units_by_seq.result(
                        result.seq,
                        result.dropped_seqs,
                        now,
                        timings.prefill_ms + timings.generate_ms,
                        timings.wall_clock_ms,
                    )

            async def receive_all() -> None:
                try:
                    await receive()
                except Exception as exc:
                    s.errors.append(f"session stream: {type(exc).__name__}")
                finally:
                    done.set()

            receiver = asyncio.create_task(receive_all())

            async def send(k: int) -> bool:
                if done.is_set():
                    return False
                units_by_seq.send(k + 1)
                requests.put_nowait(
                    worker_pb.SessionRequest(unit=worker_pb.Unit(seq=k + 1, pcm=pcms[k]))
                )
                return True

            await _paced(len(units), send)
            await _settle(units_by_seq.settled, done, 5.0)
            requests.put_nowait(
                worker_pb.SessionRequest(
                    close=worker_pb.SessionClose(reason=common_pb2.CLOSE_REASON_USER_STOP)
                )
            )
            await asyncio.wait_for(done.wait(), 15)
            receiver.cancel()
            requests.put_nowait(None)
        except Exception as exc:
            s.errors.append(f"{type(exc).__name__}: {str(exc)[:100]}")
        finally:
            acquire.cancel()
        units_by_seq.tally(closed_cleanly=ended == [common_pb2.CLOSE_REASON_USER_STOP])


# ---- the stack this command starts --------------------------------------------------------


@dataclass
class Stack:
    """Scheduler, workers and edge (tools.serve's children), plus the echo server."""

    children: list[Any]
    url: str
    scheduler: str
    echo_url: str
    pids: dict[str, int]

    def stop(self) -> None:
        from omnifabric.tools.serve import stop

        for kind in ("echo", "edge", "worker", "scheduler"):
            group = [c for c in self.children if c.name.rstrip("0123456789") == kind]
            stop(group, 2.0, who="omnifabric bench")


def start_stack(args: argparse.Namespace, paths: list[str], log_dir: Path) -> Stack:
    """Start what the measured paths need: scheduler and synthetic workers (fabric without
    --url, grpc-direct), the edge (fabric without --url), the echo server (ws-echo)."""
    from omnifabric.tools.serve import spawn

    host = args.host
    children: list[Any] = []
    pids: dict[str, int] = {"client": os.getpid()}
    if args.edge_pid:
        pids["edge"] = args.edge_pid
    stack = Stack(children, args.url or "", "", "", pids)
    own_fabric = "fabric" in paths and not args.url
    try:
        if own_fabric or "grpc-direct" in paths:
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
        if own_fabric:
            edge = spawn(
                "edge",
                "omnifabric.edge",
                [
                    *("--host", host, "--port", "0", "--grpc-port", "0"),
                    *("--scheduler", stack.scheduler, "--grace", "2"),
                ],
                log_dir / "edge.log",
            )
            children.append(edge)
            stack.url = edge.wait_ready(args.ready_timeout).split()[0]
            pids["edge"] = edge.proc.pid
        if "ws-echo" in paths:
            echo = spawn(
                "echo", "omnifabric.tools.bench", ["--echo-server", host], log_dir / "echo.log"
            )
            children.append(echo)
            _wait_line(echo, log_dir / "echo.log", "echo ready: ", args.ready_timeout)
            text = (log_dir / "echo.log").read_text()
            stack.echo_url = text.split("echo ready: ")[1].split()[0]
            pids["echo"] = echo.proc.pid
    except BaseException:
        stack.stop()
        raise
    return stack


def _wait_line(child, log: Path, prefix: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while prefix not in (log.read_text() if log.exists() else ""):
        if child.proc.poll() is not None:
            raise RuntimeError(f"{child.name} exited ({child.proc.returncode}): {log}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{child.name} not ready after {timeout_s:.0f} s: {log}")
        time.sleep(0.05)


def _metric_sum(address: str, name: str) -> float:
    """Sum of a metric's samples on a /metrics page (all labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
    return total


async def _edge_idle(url: str, timeout_s: float) -> bool:
    """Until the edge has no open session (the last level's closes are done)."""
    address = url.split("://", 1)[1].split("/", 1)[0]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            active = await asyncio.to_thread(_metric_sum, address, "omni_edge_sessions_active")
        except OSError:
            return False
        if active == 0:
            return True
        await asyncio.sleep(0.2)
    return False


# ---- running levels -----------------------------------------------------------------------


async def run_level(
    path: str,
    sessions: int,
    args: argparse.Namespace,
    stack: Stack,
    grpc_direct: GrpcDirect | None,
) -> Level:
    """N concurrent sessions over one path, with a progress line every --progress-every s."""
    units = unit_script(args.seconds)
    samples = Samples()
    # Session i opens at i * ramp / N s; its units follow once a second from then on, so
    # the units of all sessions stay spread over each second whatever the ramp.
    delays = [i * args.ramp_s / sessions for i in range(sessions)]
    if path == "fabric":
        frames = [append_frame(u) for u in units]
        url = f"{stack.url}?mode=audio"
        runs = [fabric_session(url, d, units, frames, samples) for d in delays]
        # A fabric of its own: every service; a --url fabric: the client (and --edge-pid).
        watched = [
            n for n in stack.pids if n != "echo" and (not args.url or n in ("client", "edge"))
        ]
    elif path == "ws-echo":
        frames = [append_frame(u) for u in units]
        runs = [echo_session(stack.echo_url, d, units, frames, samples) for d in delays]
        watched = ["echo", "client"]
    else:
        pcms = [_pcm(u) for u in units]
        assert grpc_direct is not None  # started whenever the path is measured
        runs = [grpc_direct.session(d, units, pcms, samples) for d in delays]
        watched = [n for n in stack.pids if n.startswith(("worker", "scheduler")) or n == "client"]
    watch = ProcessWatch({n: stack.pids[n] for n in watched})
    started = time.monotonic()

    async def progress() -> None:
        while True:
            await asyncio.sleep(args.progress_every)
            p99 = percentile(samples.overhead, 99) if samples.overhead else math.nan
            say(
                f"{path} x{sessions}: {time.monotonic() - started:.0f}/{args.seconds} s, "
                f"{len(samples.overhead)}/{samples.sent} answered, overhead p99 so far "
                f"{p99:.1f} ms"
            )

    # The streaming window: from the moment every session has sent its first unit to the
    # moment one sends its last. Both ends: (time, edge CPU s or None, units answered).
    steady: list[tuple[float, float | None, int]] = []

    async def steady_window() -> None:
        pid = stack.pids.get("edge") if path == "fabric" else None
        if args.seconds < 3:
            return
        for mark in (sessions, sessions * (args.seconds - 1)):
            while samples.sent < mark:
                await asyncio.sleep(0.02)
            sample = proc_sample(pid) if pid else None
            cpu = sample[0] if sample else None
            steady.append((time.monotonic(), cpu, len(samples.overhead)))

    lags: list[float] = []

    async def loop_lag() -> None:
        # The client's own event loop: a late wake-up here delays every timestamp it takes,
        # so a high lag means the measurement, not the fabric, is the bottleneck.
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.01)
            lags.append((time.monotonic() - before - 0.01) * 1000.0)

    say(f"{path} x{sessions}: {sessions} sessions x {args.seconds} s")
    profiler = _start_profile(args, stack, path, sessions)
    watch.start()
    lagger = asyncio.create_task(loop_lag())
    ticker = asyncio.create_task(progress())
    window = asyncio.create_task(steady_window())
    try:
        await asyncio.gather(*runs)
    finally:
        ticker.cancel()
        window.cancel()
        lagger.cancel()
        if profiler is not None:
            await _finish_profile(profiler)
    level = samples.fill(Level(path, sessions, args.seconds))
    level.client_loop_lag_ms = _stats(lags)
    level.processes = await watch.stop()
    level.wall_s = round(watch.wall_s, 2)
    level.machine_cores = round(watch.machine_cores, 2)
    level.steal_cores = round(watch.steal_cores, 2)
    edge = level.processes.get("edge")
    if edge and level.answered:
        level.edge_cpu_us_per_unit = round(edge["cpu_s"] / level.answered * 1e6, 1)
    if len(steady) == 2:
        (t0, cpu0, n0), (t1, cpu1, n1) = steady
        level.overhead_streaming_ms = _stats(
            [o for o, at in zip(samples.overhead, samples.sent_at, strict=True) if t0 <= at < t1]
        )
        if cpu0 is not None and cpu1 is not None and n1 > n0:
            level.edge_cpu_us_per_unit_steady = round((cpu1 - cpu0) / (n1 - n0) * 1e6, 1)
    o = level.overhead_ms
    say(
        f"{path} x{sessions}: {level.answered}/{level.units_sent} answered, lost {level.lost}, "
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
            f"(streaming only: {level.edge_cpu_us_per_unit_steady or math.nan:.0f} us)"
            if level.edge_cpu_us_per_unit
            else ""
        )
        + (f"; errors {level.errors}" if level.errors else "")
    )
    if path == "fabric" and stack.url:
        await _edge_idle(stack.url, 30)
    return level


async def measure(
    path: str,
    sessions: int,
    args: argparse.Namespace,
    stack: Stack,
    grpc_direct: GrpcDirect | None,
) -> Level:
    """run_level, again (up to --noisy-retries times) when the machine's host took more than
    --max-steal cores meanwhile: on a shared virtual machine, steal alone moves the tail
    several-fold. The attempts set aside stay in the result (`noisy_attempts`)."""
    noisy: list[dict[str, Any]] = []
    while True:
        level = await run_level(path, sessions, args, stack, grpc_direct)
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


def _start_profile(args: argparse.Namespace, stack: Stack, path: str, sessions: int):
    """py-spy on the edge for a fabric level (--profile): a flame graph SVG in --out."""
    import shutil
    import subprocess

    pid = stack.pids.get("edge")
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


async def _finish_profile(proc) -> None:
    """Stop py-spy with SIGINT: it writes the flame graph on the way out."""
    import signal

    proc.send_signal(signal.SIGINT)
    try:
        await asyncio.to_thread(proc.wait, 30)
    except Exception:
        proc.kill()


def next_probe(passed: int, failed: int | None, limit: int, resolution: float) -> int | None:
    """The next session count of the max search, None when it is done.

    Grows by half while every probe passes (up to `limit`), then bisects between the
    largest pass and the smallest failure until they are within `resolution` (a fraction
    of the pass, at least 5 sessions)."""
    if failed is None:
        if passed >= limit:
            return None
        return min(limit, max(passed + 5, int(passed * 1.5)))
    gap = max(5, int(passed * resolution))
    if failed - passed <= gap:
        return None
    return (passed + failed) // 2


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Every level of every path, the max search, and the summary."""
    out: Path = args.out
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    counts = [int(n) for n in args.sessions.split(",") if n.strip()]
    paths = [p for p in args.paths.split(",") if p]
    say(f"starting the stack (logs in {log_dir})")
    stack = await asyncio.to_thread(start_stack, args, paths, log_dir)
    grpc_direct = GrpcDirect(stack.scheduler) if "grpc-direct" in paths else None
    levels: list[Level] = []
    max_search: list[dict[str, Any]] = []
    try:
        say(
            f"fabric at {stack.url or '-'}; echo at {stack.echo_url or '-'}; "
            f"scheduler {stack.scheduler or '-'}"
        )
        if args.warmup_seconds > 0:
            warm = argparse.Namespace(**{**vars(args), "seconds": args.warmup_seconds})
            warm_n = min(max(counts), 10)
            say(f"warm-up: {warm_n} sessions x {args.warmup_seconds} s per path (not reported)")
            for path in paths:
                await run_level(path, warm_n, warm, stack, grpc_direct)
        for n in counts:
            for path in paths:
                levels.append(await measure(path, n, args, stack, grpc_direct))
        if args.find_max:
            fabric = {lv.sessions: lv for lv in levels if lv.path == "fabric"}
            passed = max((n for n, lv in fabric.items() if _within(lv, args.max_p99_ms)), default=0)
            failed = min(
                (n for n, lv in fabric.items() if n > passed and not _within(lv, args.max_p99_ms)),
                default=None,
            )
            while (n := next_probe(passed, failed, args.max_sessions, 0.1)) is not None:
                say(f"max search: {passed} passed, {failed or '-'} failed; trying {n}")
                level = await measure("fabric", n, args, stack, grpc_direct)
                ok = _within(level, args.max_p99_ms)
                max_search.append(
                    {
                        "sessions": n,
                        "p99_ms": level.overhead_ms["p99"],
                        "lost": level.lost + level.lost_sessions,
                        "passed": ok,
                    }
                )
                fabric[n] = level
                if ok:
                    passed = n
                else:
                    failed = n
            if passed and passed not in counts:
                say(f"max {passed} sessions: measuring it on every path")
                for path in paths:
                    levels.append(await measure(path, passed, args, stack, grpc_direct))
            max_sessions = passed
        else:
            max_sessions = None
    finally:
        if grpc_direct is not None:
            await grpc_direct.close()
        await asyncio.to_thread(stack.stop)
    return summarize(args, levels, max_sessions, max_search)


def _within(level: Level, max_p99_ms: float) -> bool:
    return level.ok and level.overhead_ms["p99"] <= max_p99_ms


def _ratio(a: float, b: float) -> float | None:
    if not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return None
    return round(a / b, 2)


def summarize(
    args: argparse.Namespace,
    levels: list[Level],
    max_sessions: int | None,
    max_search: list[dict[str, Any]],
) -> dict[str, Any]:
    """The JSON document: config, every level, ratios to the baselines, target checks."""
    by = {(lv.path, lv.sessions): lv for lv in levels}
    ratios = []
    for (path, n), lv in sorted(by.items(), key=lambda kv: kv[0][1]):
        if path != "fabric":
            continue
        row: dict[str, Any] = {"sessions": n}
        for base in ("ws-echo", "grpc-direct"):
            other = by.get((base, n))
            if other is None:
                continue
            for q in ("p50", "p99"):
                row[f"{q}_vs_{base}"] = _ratio(lv.overhead_ms[q], other.overhead_ms[q])
        ratios.append(row)
    targets: dict[str, Any] = {}
    at = by.get(("fabric", args.target_sessions))
    if at is not None:
        targets["at_target_sessions"] = {
            "sessions": args.target_sessions,
            "p99_ms": at.overhead_ms["p99"],
            "lost": at.lost + at.lost_sessions,
            # A unit lost in an attempt set aside for steal is lost all the same.
            "lost_in_noisy_attempts": sum(
                a["lost"] + a["lost_sessions"] for a in at.noisy_attempts
            ),
            "steal_cores": at.steal_cores,
            "passed": at.ok
            and not any(a["lost"] + a["lost_sessions"] for a in at.noisy_attempts)
            and at.overhead_ms["p99"] <= args.target_p99_ms,
            "target": f"p99 <= {args.target_p99_ms:g} ms and 0 lost",
        }
    if max_sessions is not None:
        found = {
            "max_p99_ms": args.max_p99_ms,
            "sessions": max_sessions,
            "capped": max_sessions >= args.max_sessions,
        }
        again = by.get(("fabric", max_sessions))
        if again is not None:
            # Measured once more with the baselines: near the knee the tail moves by run.
            found["remeasured_p99_ms"] = again.overhead_ms["p99"]
            found["remeasured_streaming_p99_ms"] = again.overhead_streaming_ms.get("p99")
            found["remeasured_within"] = _within(again, args.max_p99_ms)
        targets["max_sessions_within"] = found
    edge_us = [lv.edge_cpu_us_per_unit for lv in levels if lv.edge_cpu_us_per_unit]
    if edge_us:
        targets["edge_cpu_us_per_unit"] = {
            str(lv.sessions): {
                "whole_level": lv.edge_cpu_us_per_unit,
                "streaming_only": lv.edge_cpu_us_per_unit_steady,
            }
            for lv in levels
            if lv.edge_cpu_us_per_unit
        }
    return {
        "config": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("func",)
        },
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "levels": [asdict(lv) for lv in levels],
        "ratios": ratios,
        "max_search": max_search,
        "targets": targets,
    }


# ---- report: markdown and plot ------------------------------------------------------------


def markdown(result: dict[str, Any]) -> str:
    """Tables: overhead per path and count, ratios, processes, targets."""
    levels = result["levels"]
    lines = [
        "| sessions | path | units | answered | lost | dropped | overhead p50 | p95 | p99 "
        "| max | p99 while all stream | in worker p99 | client lag p99 | queue wait p99 "
        "| edge CPU per unit (level / streaming) | steal (cores) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def ms(stats: dict[str, float], key: str = "p99") -> str:
        value = stats.get(key, math.nan) if stats else math.nan
        return f"{value:.2f}" if math.isfinite(value) else "-"

    for lv in sorted(levels, key=lambda x: (x["sessions"], PATHS.index(x["path"]))):
        o = lv["overhead_ms"]
        edge, steady = lv["edge_cpu_us_per_unit"], lv["edge_cpu_us_per_unit_steady"]
        edge_text = (
            "-" if not edge else f"{edge:.0f} us" + (f" / {steady:.0f} us" if steady else "")
        )
        lines.append(
            f"| {lv['sessions']} | {lv['path']} | {lv['units_sent']} | {lv['answered']} | "
            f"{lv['lost'] + lv['lost_sessions']} | {lv['dropped']} | {o['p50']:.2f} ms | "
            f"{o['p95']:.2f} | {o['p99']:.2f} | {o['max']:.1f} | "
            f"{ms(lv['overhead_streaming_ms'])} | {ms(lv['in_worker_ms'])} | "
            f"{ms(lv['client_loop_lag_ms'])} | {ms(lv['queue_wait_ms'])} | {edge_text} | "
            f"{lv['steal_cores']:.2f}"
            + (f" ({len(lv['noisy_attempts'])} set aside)" if lv["noisy_attempts"] else "")
            + " |"
        )
    lines += [
        "",
        "| sessions | p50 / echo | p99 / echo | p50 / gRPC direct | p99 / gRPC direct |",
        "|---:|---:|---:|---:|---:|",
    ]

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    for row in result["ratios"]:
        lines.append(
            f"| {row['sessions']} | {fmt(row.get('p50_vs_ws-echo'))} | "
            f"{fmt(row.get('p99_vs_ws-echo'))} | {fmt(row.get('p50_vs_grpc-direct'))} | "
            f"{fmt(row.get('p99_vs_grpc-direct'))} |"
        )
    lines += [
        "",
        "| sessions | path | process | CPU cores | CPU s | RSS peak MiB |",
        "|---:|---|---|---:|---:|---:|",
    ]
    for lv in sorted(levels, key=lambda x: (x["sessions"], PATHS.index(x["path"]))):
        for name, p in sorted(lv["processes"].items()):
            lines.append(
                f"| {lv['sessions']} | {lv['path']} | {name} | {p['cores']:.2f} | "
                f"{p['cpu_s']:.2f} | {p['rss_mib_peak']:.1f} |"
            )
    targets = result["targets"]
    if targets:
        lines += [""]
        at = targets.get("at_target_sessions")
        if at:
            lines.append(
                f"- {at['sessions']} sessions: p99 {at['p99_ms']:.2f} ms, lost {at['lost']} "
                f"(+{at['lost_in_noisy_attempts']} in attempts set aside), steal "
                f"{at['steal_cores']:.2f} cores "
                f"(target {at['target']}): {'PASS' if at['passed'] else 'MISS'}"
            )
        mx = targets.get("max_sessions_within")
        if mx:
            capped = " (the search's cap: --max-sessions)" if mx["capped"] else ""
            again = ""
            if "remeasured_p99_ms" in mx:
                again = (
                    f"; measured again with the baselines: p99 {mx['remeasured_p99_ms']:.2f} ms"
                    f" ({'within' if mx['remeasured_within'] else 'over'} the limit)"
                )
            lines.append(
                f"- largest session count with p99 <= {mx['max_p99_ms']:g} ms and nothing "
                f"lost: {mx['sessions']}{capped}{again}"
            )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Overhead p50/p95/p99 against session count, one colour per path (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    colours = {"fabric": "tab:red", "ws-echo": "tab:blue", "grpc-direct": "tab:green"}
    styles = {"p50": ":", "p95": "--", "p99": "-"}
    for name in PATHS:
        points = sorted(
            (lv["sessions"], lv["overhead_ms"]) for lv in result["levels"] if lv["path"] == name
        )
        if not points:
            continue
        xs = [n for n, _ in points]
        for q, style in styles.items():
            ax.plot(
                xs,
                [o[q] for _, o in points],
                style,
                marker="o",
                markersize=3,
                color=colours[name],
                label=f"{name} {q}",
            )
    for y, text in (
        (result["config"]["target_p99_ms"], "p99 target"),
        (result["config"]["max_p99_ms"], "max-search limit"),
    ):
        ax.axhline(y, color="grey", linewidth=0.8)
        ax.annotate(
            text,
            (0.005, y),
            xycoords=("axes fraction", "data"),
            fontsize=8,
            va="bottom",
            color="grey",
        )
    probes = result.get("max_search") or []
    if probes:
        ax.scatter(
            [p["sessions"] for p in probes],
            [p["p99_ms"] for p in probes],
            marker="x",
            color="black",
            zorder=3,
            label="max search: fabric p99 per probe",
        )
    ax.set_xscale("log")
    ax.set_xlabel("concurrent sessions (1 unit/s each)")
    ax.set_ylabel("overhead per unit, ms (round trip - engine compute)")
    ax.set_title("omnifabric bench: fabric overhead vs baselines, same run")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---- command line -------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omnifabric bench",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--sessions", default="1,10,50,100", help="comma-separated session counts")
    p.add_argument("--seconds", type=int, default=30, help="units (seconds) per session")
    p.add_argument("--paths", default=",".join(PATHS), help="paths to measure")
    p.add_argument(
        "--ramp-s",
        type=float,
        default=1.0,
        help="open the sessions over this many seconds (1: all within the first second)",
    )
    p.add_argument(
        "--url",
        help="a running edge (ws://HOST:PORT/v1/realtime) instead of "
        "the fabric stack this command starts; baselines still run locally",
    )
    p.add_argument(
        "--edge-pid", type=int, help="with --url: the edge's pid, to measure its CPU and memory"
    )
    p.add_argument("--host", default="127.0.0.1", help="address the started services bind")
    p.add_argument("--workers", type=int, default=4, help="synthetic workers")
    p.add_argument("--slots", type=int, default=150, help="slots per worker")
    p.add_argument("--compute-ms", type=float, default=40.0, help="synthetic compute per unit")
    p.add_argument("--warmup-seconds", type=int, default=5, help="0: no warm-up round")
    p.add_argument(
        "--find-max",
        action="store_true",
        help="search the largest count with fabric p99 <= --max-p99-ms, 0 lost",
    )
    p.add_argument("--max-p99-ms", type=float, default=50.0)
    p.add_argument("--max-sessions", type=int, default=600, help="the max search's cap")
    p.add_argument(
        "--max-steal",
        type=float,
        default=0.1,
        help="cores taken by the host (steal) above which a level is measured again",
    )
    p.add_argument("--noisy-retries", type=int, default=2, help="0: keep every first attempt")
    p.add_argument("--target-sessions", type=int, default=100)
    p.add_argument("--target-p99-ms", type=float, default=20.0)
    p.add_argument("--out", type=Path, help="output folder (default: a new temp folder)")
    p.add_argument("--progress-every", type=float, default=5.0, help="seconds")
    p.add_argument("--ready-timeout", type=float, default=120.0)
    p.add_argument(
        "--profile",
        action="store_true",
        help="record the edge with py-spy during each fabric level (flame graph SVGs)",
    )
    p.add_argument(
        "--check", action="store_true", help="exit 1 when the target at --target-sessions is missed"
    )
    return p


def _run_loop(coro):
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--echo-server"]:
        return echo_server_main(argv[1] if len(argv) > 1 else "127.0.0.1")
    args = build_parser().parse_args(argv)
    try:
        counts = [int(n) for n in args.sessions.split(",") if n.strip()]
    except ValueError:
        print(
            f"omnifabric bench: --sessions: not a list of integers: {args.sessions!r}",
            file=sys.stderr,
        )
        return 2
    bad = [p for p in args.paths.split(",") if p and p not in PATHS]
    if args.ramp_s < 0 or args.ramp_s >= args.seconds:
        print("omnifabric bench: --ramp-s must be >= 0 and shorter than --seconds", file=sys.stderr)
        return 2
    if not counts or min(counts) < 1 or bad or args.seconds < 1:
        print(
            f"omnifabric bench: need --sessions >= 1, --seconds >= 1 and paths among "
            f"{', '.join(PATHS)} (got {bad or args.sessions})",
            file=sys.stderr,
        )
        return 2
    if "fabric" not in args.paths.split(",") and args.find_max:
        print("omnifabric bench: --find-max measures the fabric path", file=sys.stderr)
        return 2
    if not args.url and args.workers * args.slots < max(
        counts + [args.max_sessions if args.find_max else 0]
    ):
        print(
            f"omnifabric bench: {args.workers} workers x {args.slots} slots cannot hold "
            "every session at once (raise --slots or --workers)",
            file=sys.stderr,
        )
        return 2
    args.out = args.out or Path(tempfile.mkdtemp(prefix="omnifabric-bench-"))
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        result = _run_loop(bench(args))
    except RuntimeError as exc:
        print(f"omnifabric bench: {exc}", file=sys.stderr)
        return 1
    (args.out / "bench.json").write_text(json.dumps(result, indent=2, default=str))
    table = markdown(result)
    (args.out / "bench.md").write_text(table)
    plot(result, args.out / "bench.png")
    print(table)
    say(f"wrote {args.out / 'bench.json'}, {args.out / 'bench.md'}, {args.out / 'bench.png'}")
    at = result["targets"].get("at_target_sessions")
    if args.check and at is not None and not at["passed"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
