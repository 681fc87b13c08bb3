"""The baseline paths of `omnifabric bench`, measured in the same run as the fabric: a raw
websockets echo server (its own process) and its sessions, a raw gRPC echo server (its own
process: one gRPC exchange of the unit's PCM, nothing else), and gRPC straight to a worker
on a lease from the scheduler (no edge, no JSON)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from omnifabric.tools.perf.console import run_loop
from omnifabric.tools.perf.ledger import Samples, UnitLedger
from omnifabric.tools.perf.units import paced, settle


def echo_server_main(host: str) -> int:
    """`python -m omnifabric.tools.perf.bench --echo-server HOST`: echo every message back;
    prints `echo ready: ws://HOST:PORT`."""

    async def serve() -> None:
        from websockets.asyncio.server import serve as ws_serve

        async def echo(ws: Any) -> None:
            async for message in ws:
                await ws.send(message)

        async with ws_serve(echo, host, 0, compression=None, max_size=None) as server:
            port = server.sockets[0].getsockname()[1]
            print(f"echo ready: ws://{host}:{port}", flush=True)
            await asyncio.Future()

    run_loop(serve())
    return 0


async def echo_session(
    url: str, delay_s: float, units: list[np.ndarray], frames: list[str], s: Samples
) -> None:
    """One session of the same frames against the echo server (order preserved: FIFO)."""
    from websockets.asyncio.client import connect

    fifo = EchoFifo(s)
    await asyncio.sleep(delay_s)
    try:
        async with connect(url, compression=None, max_size=None, open_timeout=60) as ws:

            async def receive() -> None:
                async for _ in ws:
                    fifo.answer()

            receiver = asyncio.create_task(receive())

            async def send(k: int) -> bool:
                fifo.send()
                await ws.send(frames[k])
                return True

            await paced(len(units), send)
            await settle(fifo.settled, asyncio.Event(), 5.0)
            receiver.cancel()
    except Exception as exc:
        fifo.failed(exc)
    fifo.tally()


#: The grpc-echo server's one method: a bidirectional stream of raw bytes.
GRPC_ECHO_METHOD = "/omnifabric.bench.Echo/Stream"


def grpc_echo_server_main(host: str) -> int:
    """`python -m omnifabric.tools.perf.bench --grpc-echo-server HOST`: a grpc.aio server
    (uvloop, the worker's message limits) that sends every message of a stream back;
    prints `grpc echo ready: HOST:PORT`."""

    async def serve() -> None:
        import grpc

        async def echo(requests: AsyncIterator[bytes], _context: Any) -> AsyncIterator[bytes]:
            async for message in requests:
                yield message

        limit = 16 * 2**20
        server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", limit),
                ("grpc.max_receive_message_length", limit),
            ]
        )
        service, method = GRPC_ECHO_METHOD.strip("/").split("/")
        handler = grpc.stream_stream_rpc_method_handler(echo)  # bytes in, bytes out
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {method: handler}),)
        )
        port = server.add_insecure_port(f"{host}:0")
        await server.start()
        print(f"grpc echo ready: {host}:{port}", flush=True)
        await server.wait_for_termination()

    run_loop(serve())
    return 0


class OwnConnections:
    """A gRPC path whose sessions each dial their own connection, as each WebSocket session
    has one (a shared channel would put every stream on one HTTP/2 connection, and on one
    process of an `--edge-processes N` edge)."""

    def __init__(self, address: str) -> None:
        self.address = address

    def channel(self) -> Any:
        """A new channel with a connection of its own (not gRPC's shared subchannels)."""
        import grpc

        from omnifabric.edge.fabric import channel_options

        options = [*channel_options(16 * 2**20), ("grpc.use_local_subchannel_pool", 1)]
        return grpc.aio.insecure_channel(self.address, options=options)

    async def close(self) -> None:
        """Nothing is held between sessions."""


class EchoFifo:
    """An echo session's units: each answer is the oldest unit not yet answered (an echo
    keeps the order)."""

    def __init__(self, samples: Samples) -> None:
        self.samples = samples
        self.pending: list[float] = []
        self.answered = 0

    def send(self) -> None:
        self.pending.append(time.monotonic())
        self.samples.sent += 1

    def answer(self) -> None:
        sent_at = self.pending[self.answered]
        self.samples.answer(sent_at, (time.monotonic() - sent_at) * 1000.0, 0.0)
        self.answered += 1

    def settled(self) -> bool:
        return self.answered >= len(self.pending)

    def failed(self, exc: BaseException) -> None:
        """The session broke: counted lost, the reason among the level's errors."""
        self.samples.errors.append(f"{type(exc).__name__}: {exc}"[:120])
        self.samples.lost_sessions += 1

    def tally(self) -> None:
        self.samples.lost += len(self.pending) - self.answered


class GrpcEcho(OwnConnections):
    """Sessions against the grpc-echo server: each unit's PCM as one message, answered in
    order, one connection per session."""

    async def session(
        self, delay_s: float, units: list[np.ndarray], pcms: list[bytes], s: Samples
    ) -> None:
        import grpc

        fifo = EchoFifo(s)
        await asyncio.sleep(delay_s)
        try:
            async with self.channel() as channel:
                call = channel.stream_stream(GRPC_ECHO_METHOD)()

                async def receive() -> None:
                    while (await call.read()) is not grpc.aio.EOF:
                        fifo.answer()

                receiver = asyncio.create_task(receive())

                async def send(k: int) -> bool:
                    fifo.send()
                    await call.write(pcms[k])
                    return True

                await paced(len(units), send)
                await settle(fifo.settled, asyncio.Event(), 5.0)
                await call.done_writing()
                await asyncio.wait_for(receiver, 15)
        except Exception as exc:
            fifo.failed(exc)
        fifo.tally()


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

    def worker(self, address: str) -> Any:
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
            # Written with call.write(), as the edge writes (a request iterator fed from a
            # queue would put a task switch in front of every unit).
            call = self.worker(lease.worker_address).Session()
            await call.write(
                worker_pb.SessionRequest(
                    start=worker_pb.SessionStart(
                        lease_id=lease.lease_id, session_id=session_id, mode=common_pb2.MODE_AUDIO
                    )
                )
            )
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
                await call.write(
                    worker_pb.SessionRequest(unit=worker_pb.Unit(seq=k + 1, pcm=pcms[k]))
                )
                return True

            await paced(len(units), send)
            await settle(units_by_seq.settled, done, 5.0)
            if not done.is_set():
                await call.write(
                    worker_pb.SessionRequest(
                        close=worker_pb.SessionClose(reason=common_pb2.CLOSE_REASON_USER_STOP)
                    )
                )
                await call.done_writing()
            await asyncio.wait_for(done.wait(), 15)
            receiver.cancel()
        except Exception as exc:
            s.errors.append(f"{type(exc).__name__}: {str(exc)[:100]}")
        finally:
            acquire.cancel()
        units_by_seq.tally(closed_cleanly=ended == [common_pb2.CLOSE_REASON_USER_STOP])
