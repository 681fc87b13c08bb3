"""tools/faults.py with real gRPC traffic: a worker registered to a real scheduler through
a FaultProxy (cut, blackhole, restore, delay), the command-line proxy, and the process
signal helpers. Each test prints what it measured (pytest -s shows it)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc
from omnifabric.tools import faults
from omnifabric.tools.faults import FaultProxy
from tests.conftest import ROOT, scaled

#: The scheduler's default OMNI_SCHEDULER_WORKER_TIMEOUT_S; workers report every second.
WORKER_TIMEOUT_S = 3.0
HEARTBEAT_S = 1.0


async def get_status(address: str, wait: bool = False) -> scheduler_pb.GetStatusResponse:
    """GetStatus on a new channel; `wait`: ride out the reconnect backoff that gRPC keeps
    per address (process-wide) after a refused connection."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = scheduler_grpc.SchedulerServiceStub(channel)
        return await stub.GetStatus(
            scheduler_pb.GetStatusRequest(), timeout=scaled(5), wait_for_ready=wait
        )


async def seconds_until(predicate, timeout_s: float) -> float:
    """Poll GetStatus-based `predicate` every 20 ms; seconds until it held."""
    start = time.monotonic()
    while not await predicate():
        assert time.monotonic() - start < scaled(timeout_s), "condition not met in time"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


@pytest.mark.ci_long  # a benchmark tool's own run, end to end (tests/conftest.py)
async def test_worker_through_proxy_cut_blackhole_restore(stack):
    """A worker registered THROUGH the proxy: cut() -> the scheduler drops it at once
    (reset stream); restore() -> it registers again by itself; blackhole() -> dropped by
    the scheduler's silence watchdog after about OMNI_SCHEDULER_WORKER_TIMEOUT_S;
    restore() -> back again."""
    stack.start_scheduler()
    async with FaultProxy(stack.scheduler_address) as proxy:
        # start_worker blocks on the ready line; the proxy runs on this loop meanwhile.
        await asyncio.to_thread(stack.start_worker, "--scheduler", proxy.address, name="wp")
        assert proxy.connections >= 1

        async def registered() -> bool:
            return any(
                w.worker_id == "wp" for w in (await get_status(stack.scheduler_address)).workers
            )

        async def dropped() -> bool:
            return not await registered()

        assert await registered()
        proxy.cut()
        cut_drop_s = await seconds_until(dropped, WORKER_TIMEOUT_S + 1)
        await proxy.restore()
        cut_back_s = await seconds_until(registered, 15)

        proxy.blackhole()
        hung_drop_s = await seconds_until(dropped, WORKER_TIMEOUT_S + 2)
        await proxy.restore()
        hung_back_s = await seconds_until(registered, 15)
    print(
        f"faults: cut -> worker dropped in {cut_drop_s:.2f} s, registered again "
        f"{cut_back_s:.2f} s after restore; blackhole -> dropped in {hung_drop_s:.2f} s, "
        f"registered again {hung_back_s:.2f} s after restore"
    )
    assert cut_drop_s < scaled(WORKER_TIMEOUT_S)
    # A hung network is noticed only by the watchdog: no sooner than the timeout less
    # one report interval, no later than the timeout plus its 0.5 s check period.
    assert WORKER_TIMEOUT_S - HEARTBEAT_S - 0.1 <= hung_drop_s <= scaled(WORKER_TIMEOUT_S + 1)


async def test_delay_shows_in_a_round_trip(stack):
    """set_delay(0.1) adds 100 ms each way: a unary GetStatus takes 200 ms more."""
    stack.start_scheduler()
    async with FaultProxy(stack.scheduler_address) as proxy:
        async with grpc.aio.insecure_channel(proxy.address) as channel:
            stub = scheduler_grpc.SchedulerServiceStub(channel)

            async def round_trip() -> float:
                start = time.monotonic()
                await stub.GetStatus(scheduler_pb.GetStatusRequest(), timeout=scaled(5))
                return time.monotonic() - start

            await round_trip()  # connection set up
            base = min([await round_trip() for _ in range(5)])
            proxy.set_delay(0.1)
            delayed = min([await round_trip() for _ in range(3)])
            proxy.set_delay(0)
            after = min([await round_trip() for _ in range(3)])
    print(
        f"faults: GetStatus round trip {base * 1000:.1f} ms, with 100 ms delay "
        f"{delayed * 1000:.1f} ms, after {after * 1000:.1f} ms"
    )
    assert 0.2 <= delayed - base < 0.2 + scaled(0.1)
    assert after < base + scaled(0.05)


async def test_command_line_proxy(stack):
    """`python -m omnifabric.tools.faults proxy`: traffic flows, `cut` refuses it (UNAVAILABLE),
    `restore` lets it through again, `quit` exits 0."""
    stack.start_scheduler()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "omnifabric.tools.faults",
            "proxy",
            "--target",
            stack.scheduler_address,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdin is not None and proc.stdout is not None

    def say(command: str) -> str:
        proc.stdin.write(command + "\n")
        proc.stdin.flush()
        return proc.stdout.readline().strip()

    try:
        ready = await asyncio.to_thread(proc.stdout.readline)
        assert ready.startswith("faults proxy ready: 127.0.0.1:"), ready
        address = ready.split()[3]
        assert (await get_status(address)).queue_max > 0
        assert await asyncio.to_thread(say, "cut") == "ok state=cut delay=0 connections=1"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await get_status(address)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert (await asyncio.to_thread(say, "restore")).startswith("ok state=open")
        assert (await get_status(address, wait=True)).queue_max > 0
        assert (await asyncio.to_thread(say, "delay x")).startswith("error ")
        assert (await asyncio.to_thread(say, "delay 0.05")).startswith("ok state=open delay=0.05")
        proc.stdin.write("quit\n")
        proc.stdin.flush()
        assert await asyncio.to_thread(proc.wait, scaled(5)) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _state(pid: int) -> str:
    """The process state letter from /proc (R, S, T for stopped, Z...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_stop_resume_kill_by_pid():
    """stop() freezes a process (state T), resume() lets it run, kill() ends it."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        faults.stop(proc.pid)
        deadline = time.monotonic() + scaled(5)
        while _state(proc.pid) != "T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        faults.resume(proc.pid)
        while _state(proc.pid) == "T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        faults.kill(proc.pid)
        assert proc.wait(scaled(5)) == -9
        with pytest.raises(ProcessLookupError):
            faults.kill(proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
