"""How long a new leader takes to rebuild at scale: two real scheduler processes on a
throwaway redis-server, many simulated workers and callers on the real gRPC services.

    python -m omnifabric.tools.ha_rebuild --workers 100 --slots 10 --callers 1000

Every worker registers with the leader and its slots fill with running sessions (one
holder each); then `--callers` more wait in the queue, through the edge's own client of the
scheduler pair (edge.fabric.Fabric: it re-sends a waiting caller to the next leader with how
long it waited). The leader is killed (SIGKILL, or SIGTERM with --signal term); measured
from then: when the standby leads, when every worker has registered with it again (with
its sessions), when every waiting caller is back in its queue, and whether the queue is in
the callers' original order. The workers are simulated on the real Register stream (hello
with their running sessions, as worker.registration sends it); no engine runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from omnifabric.common import children, schedulers
from omnifabric.edge.fabric import Fabric
from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc
from omnifabric.tools import redis_local

#: gRPC message limit of the simulated clients (the status of 1,000s of leases is large).
MAX_MESSAGE_BYTES = 64 << 20


@dataclass
class SimWorker:
    """One worker's Register stream, re-registered with whichever scheduler leads; its
    hello reports the leases it was granted as running sessions."""

    worker_id: str
    slots: int
    stubs: list[scheduler_grpc.SchedulerServiceStub]
    granted: dict[str, scheduler_pb.LeaseGranted] = field(default_factory=dict)
    registrations: int = 0
    registered_at: list[float] = field(default_factory=list)

    def hello(self) -> scheduler_pb.RegisterRequest:
        held = [
            scheduler_pb.HeldLease(lease_id=g.lease_id, mode=g.mode, session_id=g.session_id)
            for g in self.granted.values()
        ]
        return scheduler_pb.RegisterRequest(
            hello=scheduler_pb.WorkerHello(
                worker_id=self.worker_id,
                address=f"127.0.0.1:{20000 + int(self.worker_id[1:])}",
                slots=self.slots,
                modes=[common_pb2.MODE_AUDIO],
                engine="simulated",
                health=common_pb2.WORKER_HEALTH_SERVING,
                active_lease_ids=[h.lease_id for h in held],
                held_leases=held,
            )
        )

    async def run(self) -> None:
        while True:
            answer, _ = await schedulers.find_leader(self.stubs)
            if answer is None:
                await asyncio.sleep(0.05)
                continue
            hello = self.hello()

            async def requests(first: scheduler_pb.RegisterRequest = hello):  # type: ignore[no-untyped-def]
                yield first
                await asyncio.Event().wait()  # reports are not needed here

            call = self.stubs[answer.index].Register(requests())
            try:
                async for response in call:
                    kind = response.WhichOneof("kind")
                    if kind == "registered":
                        self.registrations += 1
                        self.registered_at.append(time.monotonic())
                    elif kind == "lease_granted":
                        self.granted[response.lease_granted.lease_id] = response.lease_granted
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.05)


async def hold(fabric: Fabric, session_id: str, leased: list[str]) -> None:
    """One caller: Acquire through the edge's client, note its lease, hold it."""
    call = fabric.scheduler.Acquire(
        scheduler_pb.AcquireRequest(mode=common_pb2.MODE_AUDIO, session_id=session_id)
    )
    with contextlib.suppress(grpc.aio.AioRpcError):
        while (message := await call.read()) is not grpc.aio.EOF:
            if message.WhichOneof("kind") == "lease":
                leased.append(session_id)


async def status(stub: scheduler_grpc.SchedulerServiceStub) -> scheduler_pb.GetStatusResponse:
    return await stub.GetStatus(scheduler_pb.GetStatusRequest(), timeout=10)


async def until(predicate, timeout_s: float, what: str) -> float:  # type: ignore[no-untyped-def]
    """time.monotonic() once `predicate()` (async) holds; RuntimeError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"not within {timeout_s:.0f} s: {what}")
        await asyncio.sleep(0.02)
    return time.monotonic()


@dataclass
class Rig:
    """What measure's steps share: the two schedulers' addresses, channels and stubs,
    which of them leads (and which stands by), the simulated workers' and callers' tasks,
    the edge's client of the pair, the sessions granted a lease, and the leader's queue."""

    addresses: list[str]
    channels: list[grpc.aio.Channel]
    stubs: list[scheduler_grpc.SchedulerServiceStub]
    leader: int
    standby: int
    tasks: list[asyncio.Future[None]] = field(default_factory=list)
    fabric: Fabric | None = None
    leased: list[str] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)
    """The leader's queue before the kill, session ids in its order."""


async def measure(args: argparse.Namespace, log_dir: Path) -> dict[str, float | bool]:
    """Two schedulers on one store, filled with workers, running sessions and waiting
    callers; the leader stopped and the standby's rebuild timed (the figures `main`
    prints). The schedulers (and a redis-server started here) stop whatever happens."""
    store = redis_local.start_redis(log_dir) if args.redis is None else None  # the caller stops it
    url = args.redis or (store.url if store else "")
    sched_args = ["--port", "0", "--metrics-port", "0", "--ha", url, "--ha-ttl", str(args.ttl)]
    sched_args += ["--queue-max", str(args.callers + 10)]
    procs: list[children.Child] = []
    try:
        rig = await _connect(await _start_schedulers(args, sched_args, log_dir, procs))
        running = await _fill(args, rig)
        figures = await _fail_over(args, rig, procs[rig.leader], running)
        for task in rig.tasks:
            task.cancel()
        await asyncio.gather(*rig.tasks, return_exceptions=True)
        assert rig.fabric is not None
        await rig.fabric.close()
        for channel in rig.channels:
            await channel.close()
        return figures
    finally:
        children.stop(procs, 2.0, who="ha_rebuild")
        if store is not None:
            store.stop()


async def _start_schedulers(
    args: argparse.Namespace, sched_args: list[str], log_dir: Path, procs: list[children.Child]
) -> list[str]:
    """sched-a, and once it leads, sched-b (each into `procs` as it starts); returns their
    gRPC addresses."""
    addresses = []
    for name in ("sched-a", "sched-b"):
        child = children.spawn(name, "omnifabric.scheduler", sched_args, log_dir / f"{name}.log")
        procs.append(child)
        addresses.append(child.wait_ready(30).split()[0])
        if name == "sched-a":
            await asyncio.sleep(args.ttl)  # the first leads
    return addresses


async def _connect(addresses: list[str]) -> Rig:
    """A channel and stub to each scheduler, and which of them leads."""
    channels = [
        grpc.aio.insecure_channel(
            a, options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        )
        for a in addresses
    ]
    stubs = [scheduler_grpc.SchedulerServiceStub(c) for c in channels]
    answer, _ = await schedulers.find_leader(stubs)
    assert answer is not None, "no scheduler leads"
    return Rig(addresses, channels, stubs, answer.index, 1 - answer.index)


async def _fill(args: argparse.Namespace, rig: Rig) -> int:
    """Every worker registered with the leader, every slot leased, every caller queued
    (the queue's order into `rig.waiting`); returns the running sessions' count."""
    stubs, leader = rig.stubs, rig.leader
    workers = [SimWorker(f"w{n}", args.slots, stubs) for n in range(args.workers)]
    rig.tasks = [asyncio.ensure_future(w.run()) for w in workers]
    await until(lambda: _count(stubs[leader], workers=args.workers), 60, "every worker registered")
    fabric = rig.fabric = Fabric(",".join(rig.addresses), MAX_MESSAGE_BYTES)
    fabric.start()
    running = args.workers * args.slots
    leased = rig.leased
    rig.tasks += [
        asyncio.ensure_future(hold(fabric, f"run{n:05d}", leased)) for n in range(running)
    ]
    await until(lambda: _leased(leased, running), 120, "every slot leased")
    for n in range(args.callers):
        rig.tasks.append(asyncio.ensure_future(hold(fabric, f"wait{n:05d}", leased)))
    await until(lambda: _count(stubs[leader], queued=args.callers), 120, "every caller queued")
    # Concurrent streams reach the scheduler in any order: its queue is the order.
    rig.waiting = [e.session_id for e in (await status(stubs[leader])).queue]
    return running


async def _fail_over(
    args: argparse.Namespace, rig: Rig, victim: children.Child, running: int
) -> dict[str, float | bool]:
    """Stop the leader (`victim`) and time the standby's rebuild from then: when it leads,
    when the workers and their sessions are back, when the callers are, and whether their
    queue kept its order."""
    standby, waiting = rig.stubs[rig.standby], rig.waiting
    victim.proc.send_signal(signal.SIGKILL if args.signal == "kill" else signal.SIGTERM)
    t0 = time.monotonic()
    led = await until(lambda: _leads(standby), 60, "the standby leads")
    rebuilt_workers = await until(
        lambda: _count(standby, workers=args.workers, leases=running),
        120,
        "every worker and running session back",
    )
    requeued = await until(lambda: _count(standby, queued=args.callers), 120, "every caller back")
    after = [e.session_id for e in (await status(standby)).queue]
    misplaced = [
        n for n, pair in enumerate(zip(after, waiting, strict=False)) if len(set(pair)) > 1
    ]
    if misplaced:
        n = misplaced[0]
        print(f"first out of place: #{n + 1} is {after[n]}, was {waiting[n]}")
    identity = await schedulers.ask(standby, rig.standby, 5)
    return {
        "standby_leads_s": led - t0,
        "workers_back_s": rebuilt_workers - t0,
        "callers_back_s": requeued - t0,
        "order_kept": after == waiting,
        "misplaced": float(len(misplaced) + abs(len(after) - len(waiting))),
        "leader_rebuild_s": (identity.rebuild_s if identity and identity.rebuild_s else -1.0),
    }


async def _leads(stub: scheduler_grpc.SchedulerServiceStub) -> bool:
    answer = await schedulers.ask(stub, 0, 0.5)
    return answer is not None and answer.leading


async def _count(
    stub: scheduler_grpc.SchedulerServiceStub, workers: int = 0, queued: int = 0, leases: int = 0
) -> bool:
    try:
        now = await status(stub)
    except grpc.aio.AioRpcError:
        return False
    held = sum(len(w.lease_ids) for w in now.workers)
    return len(now.workers) >= workers and now.queue_length >= queued and held >= leases


async def _leased(leased: list[str], n: int) -> bool:
    return len(leased) >= n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m omnifabric.tools.ha_rebuild", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--workers", type=int, default=100, help="simulated workers")
    parser.add_argument("--slots", type=int, default=10, help="sessions per worker (all run)")
    parser.add_argument("--callers", type=int, default=1000, help="callers waiting in the queue")
    parser.add_argument("--ttl", type=float, default=1.0, help="leader key TTL, s (--ha-ttl)")
    parser.add_argument("--signal", choices=("kill", "term"), default="kill")
    parser.add_argument("--redis", help="an election store URL (default: start redis-server)")
    parser.add_argument("--log-dir", type=Path, help="the schedulers' logs (default: a temp dir)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ha-rebuild-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        try:
            figures = asyncio.run(measure(args, log_dir))
        except (RuntimeError, FileNotFoundError) as exc:
            print(f"ha_rebuild: {exc}", file=sys.stderr)
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
