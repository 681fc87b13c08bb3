"""The scheduler under a simulated fleet, measured on the scheduler's side (issue 55).

    omnifabric fleet-bench --levels 10x8,100x64 --seconds 30
    python -m omnifabric.tools.fleet_bench --levels 1000x64 --session-s 300 --load 0.9
    omnifabric fleet-bench --levels 100x64 --load 1 --overload 1.2 --session-s 60

Per level (workers x slots) a fresh scheduler runs alone in its own process; simulated
workers run in `--worker-procs` processes, each worker on its own connection with the real
Register stream (hello with headroom, a report every second with its headroom and the
leases it holds, lease_released for every revocation); callers run in `--caller-procs`
processes, each one an edge: one channel, the edge's own Acquire path (edge.fabric's
wait_for_lease on worker_client.acquire_request). Sessions last an exponential time of mean
`--session-s`; the level starts with the steady state's sessions already running (`--load`
of the slots: exponential lengths make their time left the same law) and then sessions
arrive at the rate that keeps it (load x slots / session-s per second) for `--seconds`
(`--overload 1.2 --load 1`: 20 % faster, so that callers queue).

Figures per level: Acquire latency from request to grant (p50/p99/max) of the steady
arrivals, how many waited in the queue and the error of the ETA they were first given
(estimated_wait_s less the wait that followed: median and p90 of its size, mean bias),
reports handled per second, the scheduler's CPU (share of one core) and RSS from
/proc/<pid>, its event-loop lag (its own probe, scheduler.liveness, from /metrics), the
workers it declared lost and leases lost, GetStatus's time and size, and the simulators'
own loop lag (large: the simulator, not the scheduler, was behind).

The probe (`--probe-rate`, 10 a second by default) is one more edge process beside the
callers, with short sessions of its own: its loop is idle, and the other simulators run at
a lower priority (niceness SIMULATOR_NICE) on the cores it shares with them, so its Acquire
p50/p99 is what a caller sees of the scheduler when the callers' processes are not the
ones behind: on a host with too few cores for the fleet the callers play (their loop lag
says so), the callers' own figures measure them, the probe's the scheduler.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, Queue
from typing import Any

import grpc

from omnifabric.common import children, grpc_io, schedulers, stats
from omnifabric.edge import events as ev
from omnifabric.edge.fabric import Fabric, wait_for_lease
from omnifabric.edge.worker_client import acquire_request
from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc
from omnifabric.tools.perf.metrics import metric, scrape_metrics
from omnifabric.tools.perf.procs import proc_sample

#: gRPC message limit of the simulated clients (a large fleet's status is large).
MAX_MESSAGE_BYTES = 256 << 20
#: Seconds between a simulated worker's reports (worker.registration.HEARTBEAT_S).
REPORT_S = 1.0
#: At most this many Acquires in flight per caller process while the level fills.
FILL_CONCURRENCY = 200
#: A simulated worker's wait before registering again, and between asking several
#: schedulers which leads (worker.config's register_backoff_s default).
REGISTER_BACKOFF_S = 0.2
#: How often the simulators' own loop probe wakes, seconds.
PROBE_S = 0.05
#: After the last arrival, the longest wait for the steady phase's last grants, seconds.
SETTLE_S = 10.0
#: The probe's sessions: mean length, seconds (short, so that they add next to no load).
PROBE_SESSION_S = 1.0
#: The niceness of the other simulators while a probe runs beside them: the probe, asleep
#: between its few Acquires, wakes ahead of them on the cores they share.
SIMULATOR_NICE = 10


@dataclass(frozen=True)
class Level:
    workers: int
    slots: int

    @property
    def name(self) -> str:
        return f"{self.workers}x{self.slots}"


def parse_levels(text: str) -> list[Level]:
    """'10x8,100x64' -> [Level(10, 8), Level(100, 64)]."""
    levels = []
    for part in text.split(","):
        workers, _, slots = part.strip().partition("x")
        levels.append(Level(int(workers), int(slots)))
    return levels


def percentile(values: list[float], q: float) -> float:
    """``common.stats.percentile`` with 0 for no values (the report's JSON has no NaN)."""
    return stats.percentile(values, q, empty=0.0)


class LoopProbe:
    """A simulator process's own event-loop lateness: when it is large, the figures measure
    the simulator, not the scheduler."""

    def __init__(self) -> None:
        self.lateness: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + PROBE_S
            await asyncio.sleep(PROBE_S)
            self.lateness.append(loop.time() - due)

    def figures(self) -> dict[str, float]:
        return {
            "lag_p99_ms": percentile(self.lateness, 99) * 1000,
            "lag_max_ms": max(self.lateness, default=0.0) * 1000,
        }


async def read_command() -> str:
    """The next line the orchestrator writes on our stdin ("" at its end)."""
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    return line.strip()


def say(line: str, payload: dict[str, Any] | None = None) -> None:
    """One line to the orchestrator: a word, and a JSON payload after it."""
    print(line if payload is None else f"{line} {json.dumps(payload)}", flush=True)


# ---- simulated workers ------------------------------------------------------------------


@dataclass
class WorkerStats:
    registrations: int = 0
    reports: int = 0
    grants: int = 0
    revocations: int = 0
    stream_ends: int = 0


def _headroom(slots: int, held: Iterable[str]) -> scheduler_pb.Headroom:
    """A batched engine's headroom that keeps `slots` sessions within the real-time margin,
    with every held lease listed (a report's largest form)."""
    cost = 0.5 / slots
    return scheduler_pb.Headroom(
        engine_threads=1,
        costs=[
            scheduler_pb.ModeCost(mode=common_pb2.MODE_AUDIO, session_cost=cost, added_cost=cost)
        ],
        late_window_s=30.0,
        unit_p95_ratio=0.4,
        late_units_by_lease={lease_id: 0 for lease_id in held},
    )


class SimWorker:
    """One worker on its own connections: Register, a report every REPORT_S, a release for
    every revocation; registers again whenever its stream ends. Given several scheduler
    addresses (active/standby, comma-separated) it registers with whichever leads, asking
    them as worker.registration does; its hello names every lease it holds as the grant
    described it, so that a new leader rebuilds them (tools/ha_rebuild)."""

    def __init__(self, worker_id: str, slots: int, addresses: str, stats: WorkerStats) -> None:
        self.worker_id, self.slots, self.stats = worker_id, slots, stats
        self.held: dict[str, scheduler_pb.HeldLease] = {}
        """The leases granted and not revoked, by lease id (each is a running session)."""
        self._report_message: scheduler_pb.RegisterRequest | None = None
        """The report as of the leases held now (built again when they change: building a
        map of 64 leases a second for each of 1,000 workers is the simulator's own cost)."""
        self.registered = asyncio.Event()
        self._outbox: asyncio.Queue[scheduler_pb.RegisterRequest] = asyncio.Queue()
        # Its own connections, as a worker process has (no subchannel shared with the rest).
        self._channels = [
            grpc.aio.insecure_channel(
                address,
                options=[
                    ("grpc.use_local_subchannel_pool", 1),
                    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ],
            )
            for address in schedulers.addresses(addresses)
        ]
        self._stubs = [scheduler_grpc.SchedulerServiceStub(c) for c in self._channels]

    def _hello(self) -> scheduler_pb.RegisterRequest:
        n = int(self.worker_id.rsplit("-", 1)[1])
        held = [self.held[lease_id] for lease_id in sorted(self.held)]
        return scheduler_pb.RegisterRequest(
            hello=scheduler_pb.WorkerHello(
                worker_id=self.worker_id,
                address=f"10.{n // 65536 % 256}.{n // 256 % 256}.{n % 256}:22400",
                slots=self.slots,
                modes=[common_pb2.MODE_AUDIO],
                engine="simulated",
                health=common_pb2.WORKER_HEALTH_SERVING,
                active_lease_ids=[h.lease_id for h in held],
                held_leases=held,
                headroom=_headroom(self.slots, self.held),
            )
        )

    async def _requests(self) -> AsyncIterator[scheduler_pb.RegisterRequest]:
        yield self._hello()
        while True:
            yield await self._outbox.get()

    async def _report(self) -> None:
        await asyncio.sleep(random.uniform(0, REPORT_S))
        while True:
            if self._report_message is None:
                report = scheduler_pb.WorkerReport(
                    health=common_pb2.WORKER_HEALTH_SERVING,
                    headroom=_headroom(self.slots, self.held),
                    memory=common_pb2.MemoryStats(device="cuda", allocated_bytes=40 << 30),
                )
                self._report_message = scheduler_pb.RegisterRequest(report=report)
            self._outbox.put_nowait(self._report_message)
            self.stats.reports += 1
            await asyncio.sleep(REPORT_S)

    async def _leader(self) -> scheduler_grpc.SchedulerServiceStub:
        """The stub to register with: the only one, or the one that leads now (asked every
        REGISTER_BACKOFF_S until one does)."""
        if len(self._stubs) == 1:
            return self._stubs[0]
        while True:
            answer, _ = await schedulers.find_leader(self._stubs)
            if answer is not None:
                return self._stubs[answer.index]
            await asyncio.sleep(REGISTER_BACKOFF_S)

    async def run(self) -> None:
        while True:
            self._outbox = asyncio.Queue()
            call = (await self._leader()).Register(self._requests())
            reporter = asyncio.ensure_future(self._report())
            try:
                async for response in call:
                    self._on(response)
            except grpc.aio.AioRpcError:
                pass
            finally:
                reporter.cancel()
            self.stats.stream_ends += 1
            self.registered.clear()
            await asyncio.sleep(REGISTER_BACKOFF_S)

    def _on(self, response: scheduler_pb.RegisterResponse) -> None:
        kind = response.WhichOneof("kind")
        if kind == "registered":
            self.stats.registrations += 1
            self.registered.set()
        elif kind == "lease_granted":
            self.stats.grants += 1
            grant = response.lease_granted
            self.held[grant.lease_id] = scheduler_pb.HeldLease(
                lease_id=grant.lease_id, mode=grant.mode, session_id=grant.session_id
            )
            self._report_message = None
        elif kind == "lease_revoked":
            self.stats.revocations += 1
            lease_id = response.lease_revoked.lease_id
            self.held.pop(lease_id, None)
            self._report_message = None
            released = scheduler_pb.LeaseReleased(lease_id=lease_id)
            self._outbox.put_nowait(scheduler_pb.RegisterRequest(lease_released=released))

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


async def run_workers(args: argparse.Namespace) -> None:
    """Role "workers": register workers first..first+count, say "ready" once all are,
    report until "stop", then say "done" with the counts."""
    stats, probe = WorkerStats(), LoopProbe()
    probe.start()
    ids = range(args.first, args.first + args.count)
    workers = [SimWorker(f"w-{n}", args.slots, args.scheduler, stats) for n in ids]
    tasks = [asyncio.ensure_future(w.run()) for w in workers]
    await asyncio.gather(*(w.registered.wait() for w in workers))
    say("ready")
    while await read_command() not in ("stop", ""):
        pass
    say("done", {**stats.__dict__, **probe.figures()})
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.gather(*(w.close() for w in workers))


# ---- callers ----------------------------------------------------------------------------


@dataclass
class CallerStats:
    latencies: list[float] = field(default_factory=list)
    """Request to grant, seconds, of the steady phase's arrivals."""
    eta_errors: list[float] = field(default_factory=list)
    """Of the arrivals that waited: the first ETA given (estimated_wait_s of the first
    queue update) less the wait that followed it until the grant, seconds (> 0: the
    estimate was too long)."""
    queued: int = 0
    failed: int = 0
    lost: int = 0
    errors: dict[str, int] = field(default_factory=dict)


class Callers:
    """One edge's sessions: each an Acquire on the edge's own path, held for an
    exponential time, then ended (the edge cancels its stream)."""

    def __init__(self, fabric: Fabric, session_s: float) -> None:
        self.fabric = fabric
        self.session_s = session_s
        self.stats = CallerStats()
        self.measuring = False
        self.tasks: set[asyncio.Task[None]] = set()
        self._n = 0

    def spawn(self) -> asyncio.Event:
        """Start one session; the event is set once it holds its lease (or failed)."""
        self._n += 1
        decided = asyncio.Event()
        session_id = f"s{os.getpid()}-{self._n}"
        task = asyncio.ensure_future(self._session(session_id, self.measuring, decided))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return decided

    async def _session(self, session_id: str, measured: bool, decided: asyncio.Event) -> None:
        first_eta: list[tuple[float, float]] = []
        """The first queue update's estimate and when it came."""

        async def on_queued(queued: ev.Queued) -> None:
            if not first_eta:
                first_eta.append((queued.estimated_wait_s, time.perf_counter()))

        started = time.perf_counter()
        call = self.fabric.scheduler.Acquire(acquire_request("audio", session_id))
        try:
            await wait_for_lease(call, on_queued)
        except Exception as exc:
            self._failed(exc)
            return
        finally:
            decided.set()
        granted = time.perf_counter()
        if measured:
            self.stats.latencies.append(granted - started)
            if first_eta:
                estimate, told = first_eta[0]
                self.stats.queued += 1
                self.stats.eta_errors.append(estimate - (granted - told))
        try:
            await asyncio.wait_for(_until_lost(call), random.expovariate(1 / self.session_s))
            self.stats.lost += 1
        except TimeoutError:
            pass
        finally:
            call.cancel()

    def _failed(self, exc: Exception) -> None:
        self.stats.failed += 1
        name = type(exc).__name__
        self.stats.errors[name] = self.stats.errors.get(name, 0) + 1

    async def fill(self, count: int) -> None:
        """Start `count` sessions, at most FILL_CONCURRENCY waiting for a grant at once."""
        waiting: set[asyncio.Future[Any]] = set()
        for _ in range(count):
            if len(waiting) >= FILL_CONCURRENCY:
                _, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            waiting.add(asyncio.ensure_future(self.spawn().wait()))
        if waiting:
            await asyncio.wait(waiting)

    async def arrive(self, rate: float, seconds: float) -> int:
        """New sessions at `rate` a second, evenly spaced, for `seconds`; then up to
        SETTLE_S for the last of them to be granted. Returns how many still wait."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        decided = []
        for n in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, start + n / rate - loop.time()))
            decided.append(self.spawn())
        undecided = [asyncio.ensure_future(d.wait()) for d in decided if not d.is_set()]
        if undecided:
            _, still = await asyncio.wait(undecided, timeout=SETTLE_S)
            for waiting in still:
                waiting.cancel()
            return len(still)
        return 0


async def _until_lost(call: Any) -> None:
    """Read the held Acquire stream: it says something only when the lease is lost."""
    while (message := await call.read()) is not grpc.aio.EOF:
        if message.WhichOneof("kind") == "lease_lost":
            return


async def run_callers(args: argparse.Namespace) -> None:
    """Role "callers": fill `--fill` sessions, say "filled"; on "go" arrive at `--rate` for
    `--seconds` and say "done" with the figures; on "stop" end every session."""
    probe = LoopProbe()
    probe.start()
    fabric = Fabric(args.scheduler, MAX_MESSAGE_BYTES)
    callers = Callers(fabric, args.session_s)
    started = time.monotonic()
    await callers.fill(args.fill)
    say("filled", {"fill_s": time.monotonic() - started, "failed": callers.stats.failed})
    await read_command()
    callers.measuring = True
    probe.lateness.clear()
    waiting = await callers.arrive(args.rate, args.seconds)
    say("done", {**callers.stats.__dict__, "still_waiting": waiting, **probe.figures()})
    await read_command()
    for task in list(callers.tasks):
        task.cancel()
    await asyncio.gather(*callers.tasks, return_exceptions=True)
    await fabric.close()


# ---- the orchestrator -------------------------------------------------------------------


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` onto `cpus` (threads it starts later inherit it)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task), cpus)


def parse_cpus(text: str) -> set[int]:
    """--scheduler-cpus: "0" or "0,1" (cores of this host); ValueError for others."""
    cpus = {int(part) for part in text.split(",") if part.strip()}
    host = os.sched_getaffinity(0)
    if not cpus or not cpus < host:
        raise ValueError(
            f"--scheduler-cpus {text!r}: name some, not all, of this host's cores "
            f"{sorted(host)} (the rest run the simulators)"
        )
    return cpus


class Role:
    """A simulator process (this module with --role): commands on its stdin, "WORD {json}"
    lines on its stdout, its stderr into a log; on `cpus` when given, at niceness `nice`.

    The child places itself (`--on-cpus`, `--nice`: `place`), so the start needs no
    `preexec_fn`: one makes subprocess fork instead of vfork, and a fork while this
    process's gRPC threads are busy (the orchestrator scrapes and calls the schedulers)
    runs gRPC's fork handlers in a child that aborted (SIGABRT) before its exec in CI."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_dir: Path,
        cpus: set[int] | None = None,
        nice: int = 0,
    ) -> None:
        self.name = name
        self._log = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 (closed in stop)
        if cpus is not None:
            argv = [*argv, "--on-cpus", ",".join(str(cpu) for cpu in sorted(cpus))]
        if nice:
            argv = [*argv, "--nice", str(nice)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omnifabric.tools.fleet_bench", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self._lines: Queue[str] = Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put("")

    def expect(self, word: str, timeout_s: float) -> dict[str, Any]:
        """The payload of its next line that starts with `word`; RuntimeError when it ends
        or the time runs out first."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except Empty:
                raise RuntimeError(f"{self.name}: no {word!r} within {timeout_s:.0f} s") from None
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) before {word!r}")
            head, _, payload = line.partition(" ")
            if head == word:
                return json.loads(payload) if payload else {}

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass

    def stop(self, wait_s: float = 0.0) -> None:
        """End the process: it gets `wait_s` to exit by itself (after "stop")."""
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def split_evenly(total: int, parts: int) -> list[int]:
    """`total` in `parts` near-equal shares (none empty where total allows)."""
    parts = max(1, min(parts, total)) if total else 1
    return [total // parts + (1 if n < total % parts else 0) for n in range(parts)]


@dataclass
class Snapshot:
    """The scheduler seen from outside at one moment: /proc and /metrics."""

    at: float
    cpu_s: float
    rss_mib: float
    samples: dict[str, list[tuple[dict[str, str], float]]]

    @classmethod
    def take(cls, pid: int, metrics_address: str) -> Snapshot:
        cpu_s, rss_mib = proc_sample(pid) or (0.0, 0.0)
        return cls(time.monotonic(), cpu_s, rss_mib, scrape_metrics(metrics_address, 30.0))

    def value(self, name: str, **labels: str) -> float:
        return metric(self.samples, name, **labels)


def lag_quantile(before: Snapshot, after: Snapshot, q: float) -> float:
    """The q-quantile (0-1) of the scheduler's loop lag between two snapshots: the upper
    bound of the histogram bucket it falls in, seconds."""
    name = "omni_scheduler_loop_lag_seconds_bucket"
    counts = [
        (float(labels["le"]), value - before.value(name, le=labels["le"]))
        for labels, value in after.samples.get(name, [])
    ]
    counts.sort()
    total = counts[-1][1] if counts else 0.0
    for bound, cumulative in counts:
        if total and cumulative >= q * total:
            return bound
    return 0.0


def vm_hwm_mib(pid: int) -> float:
    """A process's peak resident memory (VmHWM), MiB; 0 when unreadable."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class StatusPoller:
    """GetStatus every `every_s` on a thread while the steady phase runs: its time and
    size at this fleet's scale."""

    def __init__(self, address: str, every_s: float) -> None:
        self.times: list[float] = []
        self.sizes: list[int] = []
        self._every_s = every_s
        self._stop = threading.Event()
        self._channel = grpc.insecure_channel(
            address, options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        )
        self._stub = scheduler_grpc.SchedulerServiceStub(self._channel)
        self._thread = threading.Thread(target=self._run, daemon=True)
        if every_s > 0:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            started = time.perf_counter()
            try:
                reply = self._stub.GetStatus(scheduler_pb.GetStatusRequest(), timeout=30)
            except grpc.RpcError:
                continue
            self.times.append(time.perf_counter() - started)
            self.sizes.append(reply.ByteSize())

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(35)
        self._channel.close()


@dataclass
class Plan:
    """One level's numbers: sessions running from the start, arrivals a second, and the
    mean session length that keeps them running (Little's law: running = rate x length);
    with `--overload` above 1, arrivals come that much faster than the length keeps, and
    once the slots are full the callers queue (the ETA's figures)."""

    level: Level
    running: int
    rate: float
    session_s: float

    @classmethod
    def of(cls, level: Level, args: argparse.Namespace) -> Plan:
        running = max(1, round(args.load * level.workers * level.slots))
        rate = args.rate or running / args.session_s
        return cls(level, running, rate * getattr(args, "overload", 1.0), running / rate)


def _start_scheduler(args: argparse.Namespace, log_dir: Path) -> tuple[children.Child, str, str]:
    """A scheduler alone in its own process: (child, gRPC address, metrics address)."""
    flags = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"]
    flags += ["--queue-max", "1000000", "--log-level", args.log_level]
    # --scheduler-from: another checkout's scheduler (a before/after comparison).
    env = {"PYTHONPATH": str(args.scheduler_from)} if args.scheduler_from else None
    log_path = log_dir / "scheduler.log"
    child = children.spawn("scheduler", "omnifabric.scheduler", flags, log_path, env=env)
    words = child.wait_ready(60).split()
    if args.scheduler_cpus:
        pin(child.proc.pid, args.scheduler_cpus)
    return child, words[0], words[1].removeprefix("metrics=")


def simulator_cpus(args: argparse.Namespace) -> set[int] | None:
    """The cores the simulators run on: those the scheduler was not given (None: any)."""
    if not args.scheduler_cpus:
        return None
    return os.sched_getaffinity(0) - args.scheduler_cpus


def simulator_nice(args: argparse.Namespace) -> int:
    """The niceness of the workers' and callers' processes: raised while a probe runs."""
    return SIMULATOR_NICE if args.probe_rate > 0 else 0


def _start_workers(plan: Plan, args: argparse.Namespace, address: str, log_dir: Path) -> list[Role]:
    roles, first = [], 0
    for n, count in enumerate(split_evenly(plan.level.workers, args.worker_procs)):
        argv = ["--role", "workers", "--scheduler", address, "--first", str(first)]
        argv += ["--count", str(count), "--slots", str(plan.level.slots)]
        roles.append(Role(f"workers{n}", argv, log_dir, simulator_cpus(args), simulator_nice(args)))
        first += count
    for role in roles:
        role.expect("ready", 120)
    return roles


def _start_callers(
    plan: Plan, args: argparse.Namespace, address: str, log_dir: Path
) -> tuple[list[Role], float]:
    """Caller processes, each filled with its share of the running sessions; returns them
    and the seconds the slowest one's fill took."""
    roles = []
    procs = max(1, args.caller_procs)
    for n, fill in enumerate(split_evenly(plan.running, procs)):
        argv = ["--role", "callers", "--scheduler", address, "--fill", str(fill)]
        argv += ["--rate", str(plan.rate / procs), "--seconds", str(args.seconds)]
        argv += ["--session-s", str(plan.session_s)]
        roles.append(Role(f"callers{n}", argv, log_dir, simulator_cpus(args), simulator_nice(args)))
    fills = [role.expect("filled", 1800)["fill_s"] for role in roles]
    return roles, max(fills)


def _start_probe(args: argparse.Namespace, address: str, log_dir: Path) -> list[Role]:
    """The probe (none with --probe-rate 0): one more edge, with no sessions of its own at
    the start, that asks `--probe-rate` short sessions a second and times their Acquires
    with an idle event loop, at the normal niceness where the other simulators run at
    SIMULATOR_NICE: the latency a caller sees when the callers' own processes are not the
    ones behind (they are on a host with too few cores for the fleet they play)."""
    if args.probe_rate <= 0:
        return []
    argv = ["--role", "callers", "--scheduler", address, "--fill", "0"]
    argv += ["--rate", str(args.probe_rate), "--seconds", str(args.seconds)]
    argv += ["--session-s", str(PROBE_SESSION_S)]
    role = Role("probe", argv, log_dir, simulator_cpus(args))
    role.expect("filled", 60)
    return [role]


def run_level(plan: Plan, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """One level on a fresh scheduler: fill, then the measured steady phase; its figures."""
    load_avg = os.getloadavg()[0]
    scheduler, address, metrics_address = _start_scheduler(args, log_dir)
    pid = scheduler.proc.pid
    workers: list[Role] = []
    callers: list[Role] = []
    try:
        workers = _start_workers(plan, args, address, log_dir)
        empty = Snapshot.take(pid, metrics_address)
        callers, fill_s = _start_callers(plan, args, address, log_dir)
        probes = _start_probe(args, address, log_dir)
        callers += probes
        before = Snapshot.take(pid, metrics_address)
        poller = StatusPoller(address, args.status_every)
        for role in callers:
            role.send("go")
        done = [role.expect("done", args.seconds + SETTLE_S + 120) for role in callers]
        poller.stop()
        after = Snapshot.take(pid, metrics_address)
        for role in callers + workers:
            role.send("stop")
        sims = done + [role.expect("done", 60) for role in workers]
        edges, probed = done[: len(done) - len(probes)], done[len(done) - len(probes) :]
        figures = _figures(plan, before, after, edges, sims, poller)
        figures.update(_probe_figures(probed))
        figures.update(_fill_figures(plan, fill_s, empty, before), load_avg=load_avg)
        figures.update(scheduler_cpus=sorted(args.scheduler_cpus or ()))
        figures["rss_peak_mib"] = vm_hwm_mib(pid)
        return figures
    finally:
        # The edges go first, then the workers: the scheduler is stopped with nothing left.
        for role in callers + workers:
            role.stop(wait_s=30)
        children.stop([scheduler], 5.0, who="fleet_bench")


def _fill_figures(plan: Plan, fill_s: float, empty: Snapshot, filled: Snapshot) -> dict[str, float]:
    """The fill: every running session granted as fast as the callers ask (at most
    FILL_CONCURRENCY waiting per caller process): its rate and the scheduler's CPU."""
    return {
        "fill_s": fill_s,
        "fill_per_s": plan.running / fill_s,
        "fill_cpu_pct": 100 * (filled.cpu_s - empty.cpu_s) / fill_s,
    }


def _figures(
    plan: Plan,
    before: Snapshot,
    after: Snapshot,
    callers: list[dict[str, Any]],
    sims: list[dict[str, Any]],
    poller: StatusPoller,
) -> dict[str, Any]:
    """The level's figures from the snapshots around the steady phase and the simulators'
    reports."""
    elapsed = after.at - before.at
    latencies = [x for c in callers for x in c["latencies"]]
    eta_errors = [x for c in callers for x in c["eta_errors"]]
    errors: dict[str, int] = {}
    for c in callers:
        for name, n in c["errors"].items():
            errors[name] = errors.get(name, 0) + n
    return {
        "level": plan.level.name,
        "running": plan.running,
        "rate": plan.rate,
        "arrivals": len(latencies),
        "acquire_p50_ms": percentile(latencies, 50) * 1000,
        "acquire_p99_ms": percentile(latencies, 99) * 1000,
        "acquire_max_ms": max(latencies, default=0.0) * 1000,
        "queued": sum(c["queued"] for c in callers),
        **_eta_figures(eta_errors),
        "failed": sum(c["failed"] for c in callers),
        "still_waiting": sum(c["still_waiting"] for c in callers),
        "errors": errors,
        "reports_per_s": _rate(before, after, "omni_scheduler_worker_reports_total", elapsed),
        "grants_per_s": _rate(before, after, "omni_scheduler_leases_granted_total", elapsed),
        "cpu_pct": 100 * (after.cpu_s - before.cpu_s) / elapsed,
        "rss_mib": after.rss_mib,
        "lag_p50_ms": lag_quantile(before, after, 0.5) * 1000,
        "lag_p99_ms": lag_quantile(before, after, 0.99) * 1000,
        "lag_max_ms": after.value("omni_scheduler_loop_lag_max_seconds") * 1000,
        "stalled_s": after.value("omni_scheduler_stalled_seconds_total"),
        "workers_lost": after.value("omni_scheduler_workers_lost_total"),
        "workers_hung": after.value("omni_scheduler_workers_hung_total"),
        "leases_lost": after.value("omni_scheduler_leases_lost_total"),
        "status_p50_ms": percentile(poller.times, 50) * 1000,
        "status_max_ms": max(poller.times, default=0.0) * 1000,
        "status_kib": max(poller.sizes, default=0) / 1024,
        "callers_lag_max_ms": max((c["lag_max_ms"] for c in callers), default=0.0),
        "workers_lag_max_ms": max((s["lag_max_ms"] for s in sims if "reports" in s), default=0.0),
    }


def _probe_figures(probed: list[dict[str, Any]]) -> dict[str, float | None]:
    """The probe's Acquire latency p50/p99, its own loop lag and its failed Acquires (None
    and 0 without a probe)."""
    if not probed:
        return {
            "probe_p50_ms": None,
            "probe_p99_ms": None,
            "probe_lag_max_ms": None,
            "probe_failed": 0,
        }
    [probe] = probed
    return {
        "probe_p50_ms": percentile(probe["latencies"], 50) * 1000,
        "probe_p99_ms": percentile(probe["latencies"], 99) * 1000,
        "probe_lag_max_ms": probe["lag_max_ms"],
        "probe_failed": probe["failed"],
    }


def _eta_figures(errors: list[float]) -> dict[str, float]:
    """The queue's estimate against the waits that followed it: median and p90 of the
    error's size, and its mean sign (> 0: waits were shorter than estimated), seconds."""
    sizes = [abs(x) for x in errors]
    return {
        "eta_error_median_s": percentile(sizes, 50),
        "eta_error_p90_s": percentile(sizes, 90),
        "eta_bias_s": sum(errors) / len(errors) if errors else 0.0,
    }


def _rate(before: Snapshot, after: Snapshot, name: str, elapsed: float) -> float:
    return (after.value(name) - before.value(name)) / elapsed


COLUMNS = (
    ("level", "level", "{}"),
    ("running", "sessions", "{:,}"),
    ("rate", "arrivals/s", "{:.0f}"),
    ("fill_per_s", "fill grants/s", "{:.0f}"),
    ("fill_cpu_pct", "fill CPU %", "{:.0f}"),
    ("acquire_p50_ms", "Acquire p50 ms", "{:.1f}"),
    ("acquire_p99_ms", "p99 ms", "{:.1f}"),
    ("probe_p50_ms", "probe p50 ms", "{:.1f}"),
    ("probe_p99_ms", "probe p99 ms", "{:.1f}"),
    ("queued", "queued", "{}"),
    ("eta_error_median_s", "ETA err p50 s", "{:.1f}"),
    ("eta_error_p90_s", "ETA err p90 s", "{:.1f}"),
    ("eta_bias_s", "ETA bias s", "{:+.1f}"),
    ("reports_per_s", "reports/s", "{:.0f}"),
    ("cpu_pct", "sched CPU %", "{:.0f}"),
    ("rss_mib", "RSS MiB", "{:.0f}"),
    ("lag_p99_ms", "loop lag p99 ms", "{:g}"),
    ("lag_max_ms", "lag max ms", "{:.0f}"),
    ("workers_lost", "workers lost", "{:.0f}"),
    ("leases_lost", "leases lost", "{:.0f}"),
    ("status_p50_ms", "GetStatus ms", "{:.0f}"),
    ("status_kib", "status KiB", "{:.0f}"),
    ("callers_lag_max_ms", "callers lag max ms", "{:.0f}"),
    ("workers_lag_max_ms", "workers lag max ms", "{:.0f}"),
    ("load_avg", "load", "{:.1f}"),
)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The levels as a markdown table."""
    lines = [
        "| " + " | ".join(title for _, title, _ in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for row in rows:
        cells = ("-" if row.get(key) is None else fmt.format(row[key]) for key, _, fmt in COLUMNS)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omnifabric fleet-bench", description=__doc__.split("\n\n")[0]
    )
    add = parser.add_argument
    add("--levels", default="10x8,100x16,100x64", help="workers x slots, comma-separated")
    add("--seconds", type=float, default=30.0, help="steady phase per level, s")
    add("--session-s", type=float, default=300.0, help="mean session length, s")
    add("--load", type=float, default=0.9, help="share of the slots in use at steady state")
    add("--rate", type=float, default=0.0, help="arrivals a second (0: what keeps --load)")
    add(
        "--overload",
        type=float,
        default=1.0,
        help="arrivals this many times the rate that keeps --load (above 1 with --load 1: "
        "callers queue)",
    )
    add("--worker-procs", type=int, default=2, help="processes for the simulated workers")
    add("--caller-procs", type=int, default=2, help="processes for the callers (edges)")
    add("--status-every", type=float, default=2.0, help="GetStatus period, s (0: none)")
    add(
        "--probe-rate",
        type=float,
        default=10.0,
        help="the probe's short sessions a second (0: no probe): one more edge that times "
        "its Acquires with an idle event loop, ahead of the other simulators on their cores",
    )
    add("--log-level", default="INFO", help="the scheduler's log level")
    add(
        "--scheduler-from",
        type=Path,
        help="run the scheduler from this folder on PYTHONPATH (holding an `omnifabric` "
        "package: another checkout, for before/after figures)",
    )
    add(
        "--scheduler-cpus",
        type=parse_cpus,
        default=None,
        help="cores for the scheduler alone, e.g. 0 (the simulators get the rest): the "
        "scheduler on one core of its own",
    )
    add("--json", type=Path, help="also write the figures here")
    add("--log-dir", type=Path, help="every process's log (default: a temporary folder)")
    # A simulator process's own arguments (the orchestrator starts them).
    add("--role", choices=("workers", "callers"), help=argparse.SUPPRESS)
    add("--scheduler", help=argparse.SUPPRESS)
    add("--first", type=int, default=0, help=argparse.SUPPRESS)
    add("--count", type=int, default=0, help=argparse.SUPPRESS)
    add("--slots", type=int, default=0, help=argparse.SUPPRESS)
    add("--fill", type=int, default=0, help=argparse.SUPPRESS)
    add("--on-cpus", default="", help=argparse.SUPPRESS)
    add("--nice", type=int, default=0, help=argparse.SUPPRESS)
    return parser


def place(args: argparse.Namespace) -> None:
    """A simulator process onto its cores (`--on-cpus`) and niceness (`--nice`), before
    it starts a thread (the threads inherit both)."""
    if args.on_cpus:
        os.sched_setaffinity(0, {int(cpu) for cpu in args.on_cpus.split(",")})
    if args.nice:
        os.nice(args.nice)


def _measure(
    args: argparse.Namespace, log_dir: Path, emit: Callable[[str], None]
) -> list[dict[str, Any]]:
    rows = []
    for level in parse_levels(args.levels):
        plan = Plan.of(level, args)
        emit(
            f"level {level.name}: {plan.running:,} sessions running, {plan.rate:.1f} "
            f"arrivals/s for {args.seconds:g} s (load average {os.getloadavg()[0]:.2f})"
        )
        level_dir = log_dir / level.name
        level_dir.mkdir(parents=True, exist_ok=True)
        rows.append(run_level(plan, args, level_dir))
        emit(markdown(rows[-1:]).splitlines()[-1])
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.role:
        place(args)
    grpc_io.choose()  # the simulators and the scheduler inherit the fabric's gRPC I/O
    if args.role == "workers":
        asyncio.run(run_workers(args))
        return 0
    if args.role == "callers":
        asyncio.run(run_callers(args))
        return 0
    # The orchestrator (its GetStatus poller parses every reply) stays off the scheduler's
    # cores too, for the run (main may be called in a process that goes on).
    host = os.sched_getaffinity(0)
    with tempfile.TemporaryDirectory(prefix="fleet-bench-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        try:
            os.sched_setaffinity(0, simulator_cpus(args) or host)
            rows = _measure(args, log_dir, lambda line: print(line, flush=True))
        except RuntimeError as exc:
            print(f"fleet_bench: {exc} (logs: {log_dir})", file=sys.stderr)
            return 1
        finally:
            os.sched_setaffinity(0, host)
    print()
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    lost = sum(r["workers_lost"] + r["leases_lost"] + r["failed"] + r["probe_failed"] for r in rows)
    return 0 if lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
