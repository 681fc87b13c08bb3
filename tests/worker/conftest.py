"""Worker test fixtures: a small real scheduler (Register only), workers, session clients."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest

from omnifabric.omni.realtime.v1 import common_pb2
from omnifabric.omni.realtime.v1 import scheduler_service_pb2 as scheduler_pb
from omnifabric.omni.realtime.v1 import scheduler_service_pb2_grpc as scheduler_grpc
from omnifabric.omni.realtime.v1 import worker_service_pb2 as worker_pb
from omnifabric.omni.realtime.v1 import worker_service_pb2_grpc as worker_grpc
from omnifabric.worker.config import WorkerConfig
from omnifabric.worker.engine import Engine
from omnifabric.worker.server import RunningWorker, start_worker
from tests.conftest import scaled


class FakeScheduler(scheduler_grpc.SchedulerServiceServicer):
    """SchedulerService.Register only: answers `registered`, lets the test push lease
    grants and revocations and observe hellos, reports and releases."""

    def __init__(self) -> None:
        self.hellos: asyncio.Queue[scheduler_pb.WorkerHello] = asyncio.Queue()
        self.reports: asyncio.Queue[scheduler_pb.WorkerReport] = asyncio.Queue()
        self.released: asyncio.Queue[str] = asyncio.Queue()
        self._outboxes: dict[str, asyncio.Queue[scheduler_pb.RegisterResponse]] = {}
        self.server: grpc.aio.Server | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> None:
        self.server = grpc.aio.server()
        scheduler_grpc.add_SchedulerServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
            self.server = None
        self._outboxes.clear()

    async def Register(self, request_iterator, context):
        requests = aiter(request_iterator)
        first = await anext(requests)
        hello = first.hello
        outbox: asyncio.Queue[scheduler_pb.RegisterResponse] = asyncio.Queue()
        self._outboxes[hello.worker_id] = outbox
        self.hellos.put_nowait(hello)
        outbox.put_nowait(
            scheduler_pb.RegisterResponse(
                registered=scheduler_pb.Registered(worker_id=hello.worker_id)
            )
        )
        reader = asyncio.ensure_future(self._read(requests))
        try:
            while True:
                get = asyncio.ensure_future(outbox.get())
                done, _ = await asyncio.wait({get, reader}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    return
                yield get.result()
        finally:
            reader.cancel()
            if self._outboxes.get(hello.worker_id) is outbox:
                del self._outboxes[hello.worker_id]

    async def _read(self, requests) -> None:
        async for request in requests:
            kind = request.WhichOneof("kind")
            if kind == "lease_released":
                self.released.put_nowait(request.lease_released.lease_id)
            elif kind == "report":
                self.reports.put_nowait(request.report)

    def _push(self, worker_id: str, response: scheduler_pb.RegisterResponse) -> None:
        self._outboxes[worker_id].put_nowait(response)

    def grant(self, worker_id: str, lease_id: str, mode: int = common_pb2.MODE_AUDIO) -> None:
        self._push(
            worker_id,
            scheduler_pb.RegisterResponse(
                lease_granted=scheduler_pb.LeaseGranted(
                    lease_id=lease_id, slot=0, mode=mode, session_id=f"s-{lease_id}"
                )
            ),
        )

    def revoke(self, worker_id: str, lease_id: str, reason: str = "holder gone") -> None:
        self._push(
            worker_id,
            scheduler_pb.RegisterResponse(
                lease_revoked=scheduler_pb.LeaseRevoked(lease_id=lease_id, reason=reason)
            ),
        )

    async def next_released(self, timeout: float = 2.0) -> str:
        return await asyncio.wait_for(self.released.get(), scaled(timeout))


@pytest.fixture
async def scheduler() -> AsyncIterator[FakeScheduler]:
    fake = FakeScheduler()
    await fake.start()
    yield fake
    await fake.stop()


class WorkerFactory:
    """Starts workers registered with the fake scheduler; drains them at teardown."""

    def __init__(self, scheduler: FakeScheduler) -> None:
        self.scheduler = scheduler
        self.workers: list[RunningWorker] = []
        self.channels: list[grpc.aio.Channel] = []

    async def start(
        self, engine: Engine | None = None, wait: bool = True, **overrides
    ) -> RunningWorker:
        fields = {
            "port": 0,
            "scheduler_address": self.scheduler.address,
            "worker_id": f"w{len(self.workers) + 1}",
            "synthetic_compute_ms": 5.0,
            "lease_wait_s": 0.5,
            "register_backoff_s": 0.05,
            "register_backoff_max_s": 0.2,
            "drain_grace_s": 2.0,
        }
        fields.update(overrides)
        worker = await start_worker(WorkerConfig(**fields), engine=engine)
        self.workers.append(worker)
        if wait:
            await asyncio.wait_for(worker.wait_ready(), scaled(5))
            hello = await asyncio.wait_for(self.scheduler.hellos.get(), scaled(5))
            assert hello.worker_id == worker.worker_id
        return worker

    def stub(self, worker: RunningWorker) -> worker_grpc.WorkerServiceStub:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}")
        self.channels.append(channel)
        return worker_grpc.WorkerServiceStub(channel)

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()
        for worker in self.workers:
            await worker.drain_and_stop(grace=1.0)


@pytest.fixture
async def workers(scheduler: FakeScheduler) -> AsyncIterator[WorkerFactory]:
    factory = WorkerFactory(scheduler)
    yield factory
    await factory.close()


def pcm_bytes(seconds: float = 1.0, amplitude: float = 0.0, freq: float = 300.0) -> bytes:
    """float32 little-endian PCM at 16 kHz: a tone, or near-silence when amplitude is 0."""
    n = int(16000 * seconds)
    t = np.arange(n, dtype=np.float64) / 16000.0
    if amplitude:
        x = amplitude * np.sin(2 * np.pi * freq * t)
    else:
        x = np.random.default_rng(0).normal(0.0, 0.002, n)
    return x.astype("<f4").tobytes()


SPEECH = pcm_bytes(amplitude=0.3)
SILENCE = pcm_bytes()


class SessionClient:
    """One WorkerService.Session call driven by a request queue."""

    def __init__(self, stub: worker_grpc.WorkerServiceStub) -> None:
        self.requests: asyncio.Queue[worker_pb.SessionRequest | None] = asyncio.Queue()
        self.call = stub.Session(self._requests())
        self._responses = aiter(self.call)

    async def _requests(self):
        while True:
            request = await self.requests.get()
            if request is None:
                return
            yield request

    def start(self, lease_id: str, mode: int = common_pb2.MODE_AUDIO, **fields) -> None:
        self.requests.put_nowait(
            worker_pb.SessionRequest(
                start=worker_pb.SessionStart(
                    lease_id=lease_id, session_id=f"s-{lease_id}", mode=mode, **fields
                )
            )
        )

    def unit(self, seq: int, pcm: bytes = SILENCE, **fields) -> None:
        self.requests.put_nowait(
            worker_pb.SessionRequest(unit=worker_pb.Unit(seq=seq, pcm=pcm, **fields))
        )

    def close(self, reason: int = common_pb2.CLOSE_REASON_UNSPECIFIED) -> None:
        self.requests.put_nowait(
            worker_pb.SessionRequest(close=worker_pb.SessionClose(reason=reason))
        )

    def half_close(self) -> None:
        self.requests.put_nowait(None)

    async def next(self, timeout: float = 3.0) -> worker_pb.SessionResponse:
        return await asyncio.wait_for(anext(self._responses), scaled(timeout))

    async def until_ended(self, timeout: float = 5.0) -> list[worker_pb.SessionResponse]:
        """Every response up to and including `ended`; asserts the stream then ends."""
        responses = []
        while True:
            response = await self.next(timeout)
            responses.append(response)
            if response.WhichOneof("kind") == "ended":
                break
        with contextlib.suppress(StopAsyncIteration):
            extra = await self.next(timeout)
            raise AssertionError(f"response after ended: {extra}")
        return responses

    def cancel(self) -> None:
        self.call.cancel()
