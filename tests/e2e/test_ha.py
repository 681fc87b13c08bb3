"""Active/standby schedulers (--ha) across real processes: a real redis-server, two
schedulers with a short TTL, a synthetic worker and an edge given both addresses.

kill -9 of the leader (running sessions go on, the standby serves a new caller within 5 s),
SIGSTOP past the TTL then SIGCONT (the old leader steps down, its grants are refused by the
worker), SIGTERM (the standby leads within 1 s). Each prints what it measured (pytest -s).
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc
from omnifabric.omni.realtime.v1 import worker_service_pb2 as worker_pb
from omnifabric.omni.realtime.v1 import worker_service_pb2_grpc as worker_grpc
from tests.conftest import scaled
from tests.e2e.wsclient import WsClient, served_unit, wait_for
from tests.redis_server import RedisServer, redis_server  # noqa: F401 - fixture
from tests.stack import Service, Stack, start_service

#: The leader key's TTL in these tests, seconds.
TTL_S = 1.0


async def leader_of(address: str) -> scheduler_pb.GetLeaderResponse | None:
    """GetLeader of one scheduler; None when it does not answer within 0.5 s."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = scheduler_grpc.SchedulerServiceStub(channel)
        try:
            return await stub.GetLeader(scheduler_pb.GetLeaderRequest(), timeout=0.5)
        except grpc.aio.AioRpcError:
            return None


async def leads(address: str) -> bool:
    answer = await leader_of(address)
    return answer is not None and answer.leading


async def status(address: str) -> scheduler_pb.GetStatusResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = scheduler_grpc.SchedulerServiceStub(channel)
        return await stub.GetStatus(scheduler_pb.GetStatusRequest(), timeout=scaled(5))


async def ha_pair(
    stack: Stack, redis: RedisServer, ttl_s: float = TTL_S
) -> tuple[Service, Service, list[str]]:
    """Two schedulers on one Redis; the first leads (it starts alone), the second stands by.
    The stack's workers and edges are given both addresses."""
    args = ["--port", "0", "--metrics-port", "0", "--ha", redis.url, "--ha-ttl", str(ttl_s)]
    first = start_service("sched-a", "omnifabric.scheduler", args, stack.log_dir)
    stack.services.append(first)
    a = first.wait_ready()[0]
    await wait_for(lambda: leads(a), 10)
    second = start_service("sched-b", "omnifabric.scheduler", args, stack.log_dir)
    stack.services.append(second)
    b = second.wait_ready()[0]
    stack.scheduler_address = f"{a},{b}"
    return first, second, [a, b]


async def pair_serving(
    stack: Stack, redis: RedisServer, slots: int, ttl_s: float = TTL_S
) -> tuple[Service, list[str], str, WsClient]:
    """The pair, a synthetic worker w0 of `slots` and an edge given both addresses, with one
    session already served a unit: (the first scheduler, both addresses, the audio URL, the
    session's client)."""
    sched_a, _, addresses = await ha_pair(stack, redis, ttl_s)
    stack.start_worker("--slots", str(slots), "--compute-ms", "5", name="w0")
    stack.start_edge()
    url = f"{stack.url}?mode=audio"
    survivor = await WsClient.open(url)
    await survivor.start()
    await served_unit(survivor)
    return sched_a, addresses, url, survivor


async def new_caller_served(url: str, within_s: float) -> float:
    """Seconds until a new client (retried while refused) is leased a worker."""
    start = time.monotonic()
    while True:
        assert time.monotonic() - start < scaled(within_s), "no new caller served in time"
        client = await WsClient.open(url)
        first = await client.until("error", "session.queued", "session.queue_done")
        if first["type"] != "error":
            if first["type"] != "session.queue_done":
                await client.until("session.queue_done")
            took = time.monotonic() - start
            await client.close()
            return took
        assert first["error"]["code"] == "service_unavailable", first
        await client.close()
        await asyncio.sleep(0.05)


async def test_standby_refuses_and_kill9_of_the_leader_fails_over(
    redis_server,  # noqa: F811 - started first, stopped after the stack
    stack,
):
    sched_a, (a, b), url, survivor = await pair_serving(stack, redis_server, 2)
    # A standby grants nothing and says why.
    async with grpc.aio.insecure_channel(b) as channel:
        stub = scheduler_grpc.SchedulerServiceStub(channel)
        call = stub.Acquire(scheduler_pb.AcquireRequest(mode=common_pb2.MODE_AUDIO))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE
        assert info.value.details().startswith("not_leader: this scheduler is a standby")
    [lease_id] = next(w for w in (await status(a)).workers if w.worker_id == "w0").lease_ids

    sched_a.kill(signal.SIGKILL)
    killed = time.monotonic()
    await served_unit(survivor)  # the running session goes on
    served_s = await new_caller_served(url, 5)
    leader = await leader_of(b)
    assert leader is not None and leader.leading and leader.epoch == 2
    # The worker re-registered with the new leader and reported its running session.
    worker = next(w for w in (await status(b)).workers if w.worker_id == "w0")
    assert lease_id in worker.lease_ids
    await served_unit(survivor)
    assert not [e for e in survivor.events if e["type"] == "error"]
    print(f"kill -9 of the leader: a new caller served {served_s:.2f} s after it (TTL {TTL_S} s)")
    assert time.monotonic() - killed < scaled(8)


@pytest.mark.ci_long  # waits out the leader's TTL: ~6 s (tests/conftest.py)
async def test_paused_leader_steps_down_and_its_grants_are_refused(
    redis_server,  # noqa: F811 - started first, stopped after the stack
    stack,
):
    sched_a, _, (a, b) = await ha_pair(stack, redis_server)
    stack.start_worker("--slots", "2", "--compute-ms", "5", name="w0")
    async with grpc.aio.insecure_channel(a) as channel:
        stub = scheduler_grpc.SchedulerServiceStub(channel)

        async def registered(address: str) -> bool:
            return any(w.worker_id == "w0" for w in (await status(address)).workers)

        await wait_for(lambda: registered(a), 10)
        held = stub.Acquire(scheduler_pb.AcquireRequest(mode=common_pb2.MODE_AUDIO))
        reply = await held.read()
        assert reply.WhichOneof("kind") == "lease", reply
        stale = reply.lease
        assert stale.epoch == 1

        sched_a.kill(signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            await wait_for(lambda: leads(b), 10)
            took_s = time.monotonic() - stopped
            # The worker leaves the paused leader for the one with the higher epoch.
            await wait_for(lambda: registered(b), 10)
        finally:
            sched_a.kill(signal.SIGCONT)
        # Awake, it knows its term ran out: it refuses at once and stands by.
        fresh = stub.Acquire(scheduler_pb.AcquireRequest(mode=common_pb2.MODE_AUDIO))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(fresh.read(), scaled(5))
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE
        assert info.value.details().startswith("not_leader"), info.value.details()
        answer = await leader_of(a)
        assert answer is not None and not answer.leading and answer.epoch == 2
        # The lease it granted before the pause ends with its stream.
        with pytest.raises(grpc.aio.AioRpcError):
            await asyncio.wait_for(held.read(), scaled(5))

    # The worker refuses the old leader's grant: a clear error, at once.
    worker_address = stale.worker_address
    async with grpc.aio.insecure_channel(worker_address) as channel:
        session = worker_grpc.WorkerServiceStub(channel).Session()
        await session.write(
            worker_pb.SessionRequest(
                start=worker_pb.SessionStart(
                    lease_id=stale.lease_id, mode=common_pb2.MODE_AUDIO, epoch=stale.epoch
                )
            )
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(session.read(), scaled(2))
        assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert info.value.details() == (
            f"stale_epoch: lease {stale.lease_id!r} was granted by scheduler epoch 1; "
            "this worker follows epoch 2"
        )
    print(f"SIGSTOP of the leader: the standby led {took_s:.2f} s after it (TTL {TTL_S} s)")


@pytest.mark.ci_long  # a leader handed over under callers: ~5 s (tests/conftest.py)
async def test_sigterm_hands_over_within_a_second_refusing_nobody(
    redis_server,  # noqa: F811
    stack,
):
    sched_a, (a, b), url, survivor = await pair_serving(stack, redis_server, 8)
    # A steady arrival of new sessions across the handover (a rolling upgrade): each
    # must be served, none refused.
    outcomes: list[str] = []
    arriving = asyncio.Event()
    arriving.set()

    async def arrive() -> None:
        client = await WsClient.open(url)
        try:
            event = await client.until("error", "session.queue_done", timeout_s=scaled(10))
            outcomes.append(event["type"] if event["type"] != "error" else str(event["error"]))
        finally:
            await client.close()

    async def arrivals() -> None:
        tasks = []
        while arriving.is_set():
            tasks.append(asyncio.ensure_future(arrive()))
            await asyncio.sleep(0.1)
        await asyncio.gather(*tasks)

    steady = asyncio.ensure_future(arrivals())
    await asyncio.sleep(1.0)
    sched_a.kill(signal.SIGTERM)
    stopped = time.monotonic()
    while not await leads(b):
        assert time.monotonic() - stopped < scaled(1.0), "the standby did not lead within 1 s"
        await asyncio.sleep(0.01)
    took_s = time.monotonic() - stopped
    await served_unit(survivor)
    await asyncio.sleep(1.5)
    arriving.clear()
    await steady
    refused = [o for o in outcomes if o != "session.queue_done"]
    print(
        f"SIGTERM of the leader: the standby led after {took_s * 1000:.0f} ms; "
        f"{len(outcomes)} sessions arrived across it, {len(refused)} refused"
    )
    assert len(outcomes) >= 15 and not refused, refused


@pytest.mark.ci_long  # a leader killed under a queue: ~4 s (tests/conftest.py)
async def test_kill9_keeps_the_queue_order_key_counts_and_detached_sessions(
    redis_server,  # noqa: F811 - started first, stopped after the stack
    stack,
    tmp_path,
):
    """The new leader knows what the old one knew, from the fabric: the worker reports its
    sessions (a key's running session still counts against the key's limit; a detached
    resumable session can be resumed) and the edges re-send their waiting callers with how
    long each waited (they keep their order across both edges)."""
    from tests.e2e.test_resume import drop
    from tests.e2e.test_security import bearer

    keys = tmp_path / "keys"
    keys.write_text("sk-zeta max_sessions=1\nsk-other\n")
    sched_a, _, (a, b) = await ha_pair(stack, redis_server)
    stack.start_worker("--slots", "2", "--compute-ms", "5", name="w0")
    edge_args = ("--api-keys-file", str(keys), "--resume-window", "60")
    stack.start_edge(*edge_args, name="edge1")
    one = f"{stack.url}?mode=audio"
    stack.start_edge(*edge_args, name="edge2")
    two = f"{stack.url}?mode=audio"
    zeta, other = bearer("sk-zeta"), bearer("sk-other")

    holder = await WsClient.open(one, additional_headers=zeta)
    await holder.start()
    parked = await WsClient.open(one, additional_headers=other)
    token = (await parked.start())["resume_token"]
    drop(parked)
    await wait_for(lambda: _detached(a, 1), 10)
    # Both slots taken: three callers wait, across both edges, in this order.
    waiting = []
    for n, url in enumerate((one, two, one), start=1):
        client = await WsClient.open(url, additional_headers=other)
        queued = await client.until("session.queued")
        assert queued["position"] == n, queued
        waiting.append(client)

    sched_a.kill(signal.SIGKILL)
    await wait_for(lambda: leads(b), 10)
    await wait_for(lambda: _registered(b, "w0"), 10)
    await wait_for(lambda: _queued(b, 3), 10)
    # Each caller's newest position is its old one.
    await wait_for(lambda: _positions(waiting, [1, 2, 3]), 10)
    entries = (await status(b)).queue
    assert [e.position for e in entries] == [1, 2, 3]
    assert entries[0].waited_s > entries[1].waited_s > entries[2].waited_s
    assert (await status(b)).leases_detached == 1
    # The key's running session counts at the new leader (edge2 holds none of it).
    refusal = await WsClient.open(two, additional_headers=zeta)
    error = await refusal.until("error")
    assert error["error"]["code"] == "too_many_sessions", error
    # The detached session is resumed through the new leader, on the other edge.
    resumed = await WsClient.open(
        f"{two}&resume_token={token}&last_seq=1", additional_headers=other
    )
    assert (await resumed.until("session.resumed"))["session_id"]
    await served_unit(resumed)
    # Slots free up: the callers are served in their order.
    await holder.close()
    await waiting[0].until("session.queue_done")
    assert not [
        e for e in waiting[1].events + waiting[2].events if e["type"] == "session.queue_done"
    ]
    await resumed.close()
    await waiting[1].until("session.queue_done")
    await waiting[0].close()
    await waiting[2].until("session.queue_done")
    for client in (*waiting, holder, resumed):
        assert not [e for e in client.events if e["type"] == "error"], client.events


async def _detached(address: str, n: int) -> bool:
    return (await status(address)).leases_detached == n


async def _registered(address: str, worker_id: str) -> bool:
    return any(w.worker_id == worker_id for w in (await status(address)).workers)


async def _queued(address: str, n: int) -> bool:
    return (await status(address)).queue_length == n


async def _positions(clients: list[WsClient], expected: list[int]) -> bool:
    newest = []
    for client in clients:
        updates = [e for e in client.events if e["type"].startswith("session.queue")]
        newest.append(updates[-1].get("position") if updates else None)
    return newest == expected


@pytest.mark.ci_long  # waits out the leader's TTL: ~9 s (tests/conftest.py)
async def test_redis_killed_the_leader_serves_until_its_ttl_then_the_fabric_says_so(
    redis_server,  # noqa: F811
    stack,
):
    # A longer TTL: the caller served within it must be, on a loaded machine too.
    ttl_s = 3.0
    _, (a, b), url, survivor = await pair_serving(stack, redis_server, 4, ttl_s)

    redis_server.proc.kill()
    redis_server.proc.wait()
    killed = time.monotonic()
    # Within its TTL the leader still serves a new caller.
    client = await WsClient.open(url)
    await client.until("session.queue_done")
    assert time.monotonic() - killed < ttl_s
    await client.close()
    # Past it nobody leads: a new caller is refused, and told why.
    await wait_for(lambda: _nobody_leads(a, b), 10)
    refused = await WsClient.open(url)
    error = (await refused.until("error", timeout_s=scaled(15)))["error"]
    print(f"Redis killed: a new caller is told {error}")
    assert error["code"] == "service_unavailable", error
    assert "election store" in error["message"] and "redis://127.0.0.1" in error["message"]
    # The running session goes on with its worker.
    await served_unit(survivor)


async def _nobody_leads(*addresses: str) -> bool:
    return not any([await leads(address) for address in addresses])
