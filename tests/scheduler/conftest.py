"""Scheduler test fixtures: a real grpc.aio scheduler on 127.0.0.1:0 and real channels."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc
from omnifabric.scheduler.config import SchedulerConfig
from omnifabric.scheduler.core import Scheduler
from omnifabric.scheduler.server import RunningScheduler, start_server


@dataclass
class Harness:
    """A running scheduler and one client channel to it."""

    running: RunningScheduler
    channel: grpc.aio.Channel
    stub: scheduler_grpc.SchedulerServiceStub

    @property
    def core(self) -> Scheduler:
        return self.running.scheduler


StartScheduler = Callable[..., Awaitable[Harness]]


@pytest.fixture
async def start_scheduler() -> AsyncIterator[StartScheduler]:
    """Factory: start a scheduler with config overrides; everything stops at teardown."""
    harnesses: list[Harness] = []

    async def start(**overrides: Any) -> Harness:
        config = SchedulerConfig(host="127.0.0.1", port=0, **overrides)
        running = await start_server(config)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
        harness = Harness(running, channel, scheduler_grpc.SchedulerServiceStub(channel))
        harnesses.append(harness)
        return harness

    yield start
    for harness in harnesses:
        await harness.channel.close()
        await harness.running.stop(0)
    # Let cancelled handlers run their cleanup before the loop closes.
    await asyncio.sleep(0)
