"""How long a new leader takes to rebuild at scale: two real scheduler processes on a
throwaway redis-server, many simulated workers and callers on the real gRPC services.

    python -m omnifabric.tools.ha_rebuild --workers 100 --slots 64 --callers 1000

Every worker registers with the leader and its slots fill with running sessions (one
holder each); then `--callers` more wait in the queue, through the edge's own client of the
scheduler pair (edge.fabric.Fabric: it re-sends a waiting caller to the next leader with how
long it waited). The leader is killed (SIGKILL, or SIGTERM with --signal term); measured
from then: when the standby leads, when every worker has registered with it again (with
its sessions), when every waiting caller is back in its queue, and whether the queue is in
the callers' original order (the session ids of GetStatus's queue before and after). The
workers are fleet-bench's (tools/fleet_bench.SimWorker, in `--worker-procs` processes of
their own): the real Register stream, a report every second with their headroom and held
leases, a hello naming their running sessions as worker.registration does; no engine runs.
The counts are read from the schedulers' /metrics (a GetStatus of thousands of leases,
asked in a loop, would itself load the scheduler being timed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from omnifabric.common import children, schedulers
from omnifabric.edge.fabric import Fabric
from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc
from omnifabric.tools import redis_local
from omnifabric.tools.fleet_bench import FILL_CONCURRENCY, LoopProbe, Role, split_evenly
from omnifabric.tools.perf.metrics import metric, scrape_metrics
from omnifabric.tools.perf.procs import proc_sample

#: gRPC message limit of the simulated clients (the status of 1,000s of leases is large).
MAX_MESSAGE_BYTES = 64 << 20
#: How often the schedulers' /metrics are read while a count is awaited, seconds.
SCRAPE_S = 0.1


async def hold(
    fabric: Fabric, session_id: str, rig: Rig, answered: asyncio.Semaphore | None = None
) -> None:
    """One caller: Acquire through the edge's client, note its lease (`rig.leased`), hold
    it; a call refused or broken before its lease goes into `rig.failed` (code and
    details). `answered` (held by the caller) is released at its first answer, queued or
    leased, or its failure."""
    call = fabric.scheduler.Acquire(
        scheduler_pb.AcquireRequest(mode=common_pb2.MODE_AUDIO, session_id=session_id)
    )
    granted = False
    try:
        while (message := await call.read()) is not grpc.aio.EOF:
            if answered is not None:
                answered.release()
                answered = None
            if message.WhichOneof("kind") == "lease":
                granted = True
                rig.leased.append(session_id)
    except grpc.aio.AioRpcError as exc:
        if not granted:
            rig.failed.append(f"{session_id}: {exc.code().name} {exc.details()}")
    finally:
        if answered is not None:
            answered.release()


async def start_callers(fabric: Fabric, rig: Rig, prefix: str, count: int) -> None:
    """`count` callers (`hold`), at most FILL_CONCURRENCY of them not answered yet at once:
    a burst of thousands of Acquires on one connection has some cancelled before the
    scheduler sees them (fleet-bench's callers fill the same way)."""
    answered = asyncio.Semaphore(FILL_CONCURRENCY)
    for n in range(count):
        await answered.acquire()
        rig.tasks.append(asyncio.ensure_future(hold(fabric, f"{prefix}{n:05d}", rig, answered)))


#: GetStatus's bound here: the whole queue, whose order the failover must keep (the
#: scheduler lists --status-entries entries unless asked for more).
WHOLE_QUEUE = 1_000_000


async def status(stub: scheduler_grpc.SchedulerServiceStub) -> scheduler_pb.GetStatusResponse:
    request = scheduler_pb.GetStatusRequest(max_entries=WHOLE_QUEUE)
    return await stub.GetStatus(request, timeout=30)


async def until(predicate, timeout_s: float, what: str, every_s: float = 0.02) -> float:  # type: ignore[no-untyped-def]
    """time.monotonic() once `predicate()` (async) holds; RuntimeError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"not within {timeout_s:.0f} s: {what}")
        await asyncio.sleep(every_s)
    return time.monotonic()


@dataclass
class Rig:
    """What measure's steps share: the two schedulers (processes, gRPC and /metrics
    addresses, channels and stubs), which of them leads (and which stands by), the
    simulated workers' processes, the callers' tasks, the edge's client of the pair, the
    sessions granted a lease, and the leader's queue."""

    procs: list[children.Child]
    addresses: list[str]
    metrics: list[str]
    channels: list[grpc.aio.Channel]
    stubs: list[scheduler_grpc.SchedulerServiceStub]
    leader: int
    standby: int
    workers: list[Role] = field(default_factory=list)
    tasks: list[asyncio.Future[None]] = field(default_factory=list)
    fabric: Fabric | None = None
    leased: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    """Callers refused before their lease (none is expected)."""
    waiting: list[str] = field(default_factory=list)
    """The leader's queue before the kill, session ids in its order."""


async def measure(args: argparse.Namespace, log_dir: Path) -> dict[str, float | bool]:
    """Two schedulers on one store, filled with workers, running sessions and waiting
    callers; the leader stopped and the standby's rebuild timed (the figures `main`
    prints). The schedulers, the workers' processes (and a redis-server started here) stop
    whatever happens."""
    store = redis_local.start_redis(log_dir) if args.redis is None else None  # the caller stops it
    url = args.redis or (store.url if store else "")
    sched_args = ["--port", "0", "--metrics-port", "0", "--ha", url, "--ha-ttl", str(args.ttl)]
    sched_args += ["--queue-max", str(args.callers + 10)]
    procs: list[children.Child] = []
    rig: Rig | None = None
    probe = LoopProbe()
    probe.start()
    try:
        rig = await _connect(procs, await _start_schedulers(args, sched_args, log_dir, procs))
        probe.lateness.clear()  # from the fill on (the schedulers' start blocked the loop)
        figures: dict[str, float | bool] = {"load_avg_start": os.getloadavg()[0]}
        figures.update(await _fill(args, rig, log_dir))
        figures.update(await _fail_over(args, rig))
        figures.update(_worker_figures(rig), load_avg_end=os.getloadavg()[0])
        figures.update(own_lag_max_ms=probe.figures()["lag_max_ms"])
        await _close(rig)
        return figures
    finally:
        for role in rig.workers if rig else []:
            role.stop(wait_s=5)
        children.stop(procs, 2.0, who="ha_rebuild")
        if store is not None:
            store.stop()


async def _start_schedulers(
    args: argparse.Namespace, sched_args: list[str], log_dir: Path, procs: list[children.Child]
) -> list[tuple[str, str]]:
    """sched-a, and once it leads, sched-b (each into `procs` as it starts); returns their
    gRPC and /metrics addresses."""
    addresses = []
    for name in ("sched-a", "sched-b"):
        child = children.spawn(name, "omnifabric.scheduler", sched_args, log_dir / f"{name}.log")
        procs.append(child)
        words = child.wait_ready(30).split()
        addresses.append((words[0], words[1].removeprefix("metrics=")))
        if name == "sched-a":
            await asyncio.sleep(args.ttl)  # the first leads
    return addresses


async def _connect(procs: list[children.Child], addresses: list[tuple[str, str]]) -> Rig:
    """A channel and stub to each scheduler, and which of them leads."""
    channels = [
        grpc.aio.insecure_channel(
            a, options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        )
        for a, _ in addresses
    ]
    stubs = [scheduler_grpc.SchedulerServiceStub(c) for c in channels]
    answer, _ = await schedulers.find_leader(stubs)
    assert answer is not None, "no scheduler leads"
    grpc_addresses, metrics = [a for a, _ in addresses], [m for _, m in addresses]
    return Rig(procs, grpc_addresses, metrics, channels, stubs, answer.index, 1 - answer.index)


async def _close(rig: Rig) -> None:
    """The callers and their client end, the workers' processes say their counts and end."""
    for task in rig.tasks:
        task.cancel()
    await asyncio.gather(*rig.tasks, return_exceptions=True)
    if rig.fabric is not None:
        await rig.fabric.close()
    for channel in rig.channels:
        await channel.close()


def _start_workers(args: argparse.Namespace, rig: Rig, log_dir: Path) -> None:
    """The simulated workers in `--worker-procs` processes (fleet-bench's workers role),
    each worker following whichever of the two schedulers leads."""
    first = 0
    for n, count in enumerate(split_evenly(args.workers, args.worker_procs)):
        argv = ["--role", "workers", "--scheduler", ",".join(rig.addresses)]
        argv += ["--first", str(first), "--count", str(count), "--slots", str(args.slots)]
        rig.workers.append(Role(f"workers{n}", argv, log_dir))
        first += count


async def _fill(args: argparse.Namespace, rig: Rig, log_dir: Path) -> dict[str, float]:
    """Every worker registered with the leader, every slot leased, every caller queued
    (the queue's order into `rig.waiting`); the times each took from the workers' start,
    and the leader's CPU meanwhile (share of one core)."""
    leader, pid = rig.leader, rig.procs[rig.leader].proc.pid
    cpu0, t0 = _cpu_s(pid), time.monotonic()
    _start_workers(args, rig, log_dir)
    for role in rig.workers:
        await asyncio.to_thread(role.expect, "ready", 300)
    registered = await until(
        lambda: _count(rig.metrics[leader], workers=args.workers),
        60,
        "every worker registered",
        SCRAPE_S,
    )
    fabric = rig.fabric = Fabric(",".join(rig.addresses), MAX_MESSAGE_BYTES)
    fabric.start()
    running = args.workers * args.slots
    await start_callers(fabric, rig, "run", running)
    filled = await until(lambda: _leased(rig, running), 300, "every slot leased")
    await start_callers(fabric, rig, "wait", args.callers)
    queued = await until(
        lambda: _queued(rig, args.callers),
        300,
        "every caller queued",
        SCRAPE_S,
    )
    cpu = _cpu_s(pid) - cpu0
    # Concurrent streams reach the scheduler in any order: its queue is the order.
    rig.waiting = [e.session_id for e in (await status(rig.stubs[leader])).queue]
    hung = await asyncio.to_thread(scrape_metrics, rig.metrics[leader], 10.0)
    return {
        "workers_registered_s": registered - t0,
        "slots_leased_s": filled - t0,
        "fill_s": queued - t0,
        "fill_grants_per_s": running / (filled - registered),
        "leader_fill_cpu_pct": 100 * cpu / (queued - t0),
        "leader_workers_hung": metric(hung, "omni_scheduler_workers_hung_total"),
        "leader_workers_lost": metric(hung, "omni_scheduler_workers_lost_total"),
    }


async def _fail_over(args: argparse.Namespace, rig: Rig) -> dict[str, float | bool]:
    """Stop the leader and time the standby's rebuild from then: when it leads, when the
    workers and their sessions are back, when the callers are, and whether their queue
    kept its order; the standby's CPU meanwhile."""
    standby, metrics, waiting = rig.stubs[rig.standby], rig.metrics[rig.standby], rig.waiting
    running = args.workers * args.slots
    victim, pid = rig.procs[rig.leader], rig.procs[rig.standby].proc.pid
    cpu0 = _cpu_s(pid)
    victim.proc.send_signal(signal.SIGKILL if args.signal == "kill" else signal.SIGTERM)
    t0 = time.monotonic()
    led = await until(lambda: _leads(standby), 60, "the standby leads")
    back = asyncio.ensure_future(
        until(
            lambda: _count(metrics, workers=args.workers, leases=running),
            120,
            "every worker and running session back",
            SCRAPE_S,
        )
    )
    requeued = await until(
        lambda: _count(metrics, queued=args.callers), 120, "every caller back", SCRAPE_S
    )
    rebuilt_workers = await back
    cpu = _cpu_s(pid) - cpu0
    after = [e.session_id for e in (await status(standby)).queue]
    misplaced = [
        n for n, pair in enumerate(zip(after, waiting, strict=False)) if len(set(pair)) > 1
    ]
    if misplaced:
        n = misplaced[0]
        print(f"first out of place: #{n + 1} is {after[n]}, was {waiting[n]}")
    identity = await schedulers.ask(standby, rig.standby, 5)
    lost = await asyncio.to_thread(scrape_metrics, metrics, 10.0)
    return {
        "standby_leads_s": led - t0,
        "workers_back_s": rebuilt_workers - t0,
        "callers_back_s": requeued - t0,
        "order_kept": after == waiting,
        "misplaced": float(len(misplaced) + abs(len(after) - len(waiting))),
        "leader_rebuild_s": (identity.rebuild_s if identity and identity.rebuild_s else -1.0),
        "standby_rebuild_cpu_pct": 100 * cpu / (max(requeued, rebuilt_workers) - t0),
        "standby_workers_lost": metric(lost, "omni_scheduler_workers_lost_total"),
        "standby_leases_lost": metric(lost, "omni_scheduler_leases_lost_total"),
    }


def _worker_figures(rig: Rig) -> dict[str, float]:
    """The simulated workers' own counts: registrations (one each, then one each per
    switch of leader) and their processes' largest loop lag (large: the simulator was
    behind, not the scheduler)."""
    for role in rig.workers:
        role.send("stop")
    done = [role.expect("done", 60) for role in rig.workers]
    return {
        "worker_registrations": float(sum(d["registrations"] for d in done)),
        "workers_lag_max_ms": max((d["lag_max_ms"] for d in done), default=0.0),
    }


def _cpu_s(pid: int) -> float:
    sample = proc_sample(pid)
    return sample[0] if sample else 0.0


async def _leads(stub: scheduler_grpc.SchedulerServiceStub) -> bool:
    answer = await schedulers.ask(stub, 0, 0.5)
    return answer is not None and answer.leading


async def _count(metrics: str, workers: int = 0, queued: int = 0, leases: int = 0) -> bool:
    """Whether the scheduler at `metrics` has at least these workers, waiting callers and
    leases (read on a thread: the callers' loop goes on)."""
    try:
        now = await asyncio.to_thread(scrape_metrics, metrics, 10.0)
    except (OSError, urllib.error.URLError):
        return False
    return (
        metric(now, "omni_scheduler_workers") >= workers
        and metric(now, "omni_scheduler_queue_length") >= queued
        and metric(now, "omni_scheduler_leases_occupying") >= leases
    )


async def _queued(rig: Rig, n: int) -> bool:
    """Whether `n` callers wait in the leader's queue; RuntimeError once one was refused."""
    return await _leased(rig, 0) and await _count(rig.metrics[rig.leader], queued=n)


async def _leased(rig: Rig, n: int) -> bool:
    """Whether `n` callers hold a lease; RuntimeError once one was refused instead."""
    if rig.failed:
        raise RuntimeError(f"{len(rig.failed)} callers refused, the first: {rig.failed[0]}")
    return len(rig.leased) >= n


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m omnifabric.tools.ha_rebuild", description=__doc__.split("\n\n")[0]
    )
    add = parser.add_argument
    add("--workers", type=int, default=100, help="simulated workers")
    add("--slots", type=int, default=64, help="sessions per worker (all run)")
    add("--callers", type=int, default=1000, help="callers waiting in the queue")
    add("--worker-procs", type=int, default=2, help="processes for the simulated workers")
    add("--ttl", type=float, default=1.0, help="leader key TTL, s (--ha-ttl)")
    add("--signal", choices=("kill", "term"), default="kill")
    add("--redis", help="an election store URL (default: start redis-server)")
    add("--log-dir", type=Path, help="every process's log (default: a temp dir)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ha-rebuild-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        try:
            figures = asyncio.run(measure(args, log_dir))
        except (RuntimeError, FileNotFoundError) as exc:
            print(f"ha_rebuild: {exc} (logs: {log_dir})", file=sys.stderr)
            return 1
    print(
        f"{args.workers} workers x {args.slots} running sessions, {args.callers} callers waiting;"
        f" SIG{args.signal.upper()} of the leader (TTL {args.ttl:g} s):"
    )
    for name, value in figures.items():
        print(f"  {name}: {value:.3f}" if isinstance(value, float) else f"  {name}: {value}")
    return 0 if figures["order_kept"] else 1


if __name__ == "__main__":
    sys.exit(main())
