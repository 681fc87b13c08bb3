"""`python -m omnifabric.scheduler` as a real process: ready line, serving, clean exit on
SIGTERM."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys

import grpc

from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc
from tests.conftest import ROOT, scaled

READY = re.compile(rb"^omnifabric scheduler ready: 127\.0\.0\.1:(\d+) metrics=127\.0\.0\.1:\d+\n$")


async def test_module_prints_ready_line_and_stops_on_sigterm() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_SCHEDULER_")}
    env["OMNI_SCHEDULER_QUEUE_MAX"] = "9"
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "omnifabric.scheduler",
        "--port",
        "0",
        "--queue-update-interval",
        "1",
        "--metrics-port",
        "0",
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None and process.stderr is not None
        line = await asyncio.wait_for(process.stdout.readline(), scaled(10))
        match = READY.match(line)
        assert match, line
        port = int(match.group(1))
        assert port > 0

        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = scheduler_grpc.SchedulerServiceStub(channel)
            reply = await asyncio.wait_for(
                stub.GetStatus(scheduler_pb.GetStatusRequest()), scaled(5)
            )
        assert reply.queue_max == 9

        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), scaled(5)) == 0
        stderr = await process.stderr.read()
        # JSON log lines (the default format)
        assert b'"level": "INFO", "logger": "omnifabric.scheduler"' in stderr
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_bad_flag_value_exits_with_usage_error() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "omnifabric.scheduler",
        "--queue-max",
        "0",
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(process.communicate(), scaled(10))
    assert process.returncode == 2
    assert b"--queue-max must be in 1..1000000, got 0" in stderr
