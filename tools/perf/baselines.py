"""The baseline paths of `omnifabric bench`, measured in the same run as the fabric: a raw
websockets echo server (its own process) and its sessions, a raw gRPC echo server (its own
process: one gRPC exchange of the unit's PCM, nothing else; or, on its second method, the
same exchange whose answer waits for the engine's compute on a thread, as a worker's does),
a synchronous gRPC server that spends that compute on the stream's own thread (no hand-off
at all), and gRPC straight to a worker on a lease from the scheduler (no edge, no JSON)."""

from __future__ import annotations

import asyncio
import struct
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np

from omnifabric.tools.client import engine_ms
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


#: The grpc-echo server's methods, both a bidirectional stream of raw bytes: `Stream`
#: sends every message back (grpc-echo); `Thread` answers each message once a thread of a
#: pool has spent the compute on it, as a worker calls its engine (grpc-thread).
GRPC_ECHO_METHOD = "/omnifabric.bench.Echo/Stream"
GRPC_THREAD_METHOD = "/omnifabric.bench.Echo/Thread"
#: A grpc-thread answer: the compute the thread measured (ms, little-endian double), then
#: the message.
COMPUTE_HEADER = struct.Struct("<d")
#: The largest gRPC message either way, as a worker's default (--max-message-bytes).
MESSAGE_LIMIT = 16 * 2**20


def _server_options() -> list[tuple[str, int]]:
    """The baseline gRPC servers' options: a worker's own (limits, keepalive)."""
    from omnifabric.worker.server import server_options

    return server_options(MESSAGE_LIMIT)


def spend(compute_ms: float) -> float:
    """A synthetic engine's compute on the calling thread (two sleeps, as its prefill and
    generate take half each); returns the ms spent, as measured (a sleep overshoots)."""
    started = time.perf_counter()
    for _ in range(2):
        time.sleep(compute_ms / 2000.0)
    return (time.perf_counter() - started) * 1000.0


def grpc_echo_server_main(host: str, compute_ms: float) -> int:
    """`python -m omnifabric.tools.perf.bench --grpc-echo-server HOST COMPUTE_MS`: a
    grpc.aio server (uvloop, a worker's server options) with the two methods above;
    prints `grpc echo ready: HOST:PORT`."""

    async def serve() -> None:
        from concurrent.futures import ThreadPoolExecutor

        import grpc

        async def echo(requests: AsyncIterator[bytes], _context: Any) -> AsyncIterator[bytes]:
            async for message in requests:
                yield message

        # Threads enough that no unit waits for one (a synthetic worker has one per slot).
        engine = ThreadPoolExecutor(max_workers=256, thread_name_prefix="engine")

        async def thread(requests: AsyncIterator[bytes], _context: Any) -> AsyncIterator[bytes]:
            loop = asyncio.get_running_loop()
            async for message in requests:
                spent = await loop.run_in_executor(engine, spend, compute_ms)
                yield COMPUTE_HEADER.pack(spent) + message

        server = grpc.aio.server(options=_server_options())
        service = GRPC_ECHO_METHOD.strip("/").split("/")[0]
        handlers = {  # bytes in, bytes out
            m.rsplit("/", 1)[1]: grpc.stream_stream_rpc_method_handler(h)
            for m, h in ((GRPC_ECHO_METHOD, echo), (GRPC_THREAD_METHOD, thread))
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        port = server.add_insecure_port(f"{host}:0")
        await server.start()
        print(f"grpc echo ready: {host}:{port}", flush=True)
        await server.wait_for_termination()

    run_loop(serve())
    return 0


def grpc_sync_server_main(host: str, compute_ms: float) -> int:
    """`python -m omnifabric.tools.perf.bench --grpc-sync-server HOST COMPUTE_MS`: a
    synchronous gRPC server (a thread per stream, a worker's server options) whose Thread
    method spends the compute on the stream's own thread and answers as grpc.aio's does;
    prints `grpc sync ready: HOST:PORT`. What a worker whose gRPC handler ran the engine
    itself would pay: no loop, no hand-off."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    def thread(requests: Iterator[bytes], _context: Any) -> Iterator[bytes]:
        for message in requests:
            yield COMPUTE_HEADER.pack(spend(compute_ms)) + message

    server = grpc.server(
        ThreadPoolExecutor(max_workers=1024, thread_name_prefix="stream"),
        options=_server_options(),
    )
    service, method = GRPC_THREAD_METHOD.strip("/").split("/")
    handler = grpc.stream_stream_rpc_method_handler(thread)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service, {method: handler}),)
    )
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    print(f"grpc sync ready: {host}:{port}", flush=True)
    server.wait_for_termination()
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

        options = [*channel_options(MESSAGE_LIMIT), ("grpc.use_local_subchannel_pool", 1)]
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

    def answer(self, compute_ms: float = 0.0) -> None:
        sent_at = self.pending[self.answered]
        self.samples.answer(sent_at, (time.monotonic() - sent_at) * 1000.0, compute_ms)
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
    order, one connection per session; with `thread`, on its Thread method (the compute the
    server's thread measured is taken out, as the engine's is on the other paths)."""

    def __init__(self, address: str, thread: bool = False) -> None:
        super().__init__(address)
        self.method = GRPC_THREAD_METHOD if thread else GRPC_ECHO_METHOD
        self.thread = thread

    async def session(
        self, delay_s: float, units: list[np.ndarray], pcms: list[bytes], s: Samples
    ) -> None:
        import grpc

        fifo = EchoFifo(s)
        await asyncio.sleep(delay_s)
        try:
            async with self.channel() as channel:
                call = channel.stream_stream(self.method)()

                async def receive() -> None:
                    while (answer := await call.read()) is not grpc.aio.EOF:
                        fifo.answer(COMPUTE_HEADER.unpack_from(answer)[0] if self.thread else 0.0)

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

        options = channel_options(MESSAGE_LIMIT)
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

        await asyncio.sleep(delay_s)
        session_id = f"bench-{uuid.uuid4().hex[:12]}"
        units_by_seq = UnitLedger(s)
        ended: list[int] = []
        acquire = self.scheduler.Acquire(
            scheduler_pb.AcquireRequest(mode=common_pb2.MODE_AUDIO, session_id=session_id)
        )
        t0 = time.monotonic()
        try:
            lease = await _granted(acquire)
            s.queue_wait.append((time.monotonic() - t0) * 1000.0)
            call = await self._start(lease, session_id)
            await self._stream(call, units, pcms, units_by_seq, ended)
        except Exception as exc:
            s.errors.append(f"{type(exc).__name__}: {str(exc)[:100]}")
        finally:
            acquire.cancel()
        units_by_seq.tally(closed_cleanly=ended == [common_pb2.CLOSE_REASON_USER_STOP])

    async def _start(self, lease: Any, session_id: str) -> Any:
        """The worker's Session call on `lease`, once the worker said it started."""
        from omnifabric.omni.realtime.v1 import common_pb2
        from omnifabric.omni.realtime.v1 import worker_service_pb2 as worker_pb

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
        return call

    async def _stream(
        self,
        call: Any,
        units: list[np.ndarray],
        pcms: list[bytes],
        units_by_seq: UnitLedger,
        ended: list[int],
    ) -> None:
        """The units, one a second, while the results are read; then the last results, the
        close and the worker's end (its reason into `ended`)."""
        from omnifabric.omni.realtime.v1 import common_pb2
        from omnifabric.omni.realtime.v1 import worker_service_pb2 as worker_pb

        done = asyncio.Event()

        async def receive_all() -> None:
            try:
                await self._receive(call, units_by_seq, ended)
            except Exception as exc:
                units_by_seq.samples.errors.append(f"session stream: {type(exc).__name__}")
            finally:
                done.set()

        receiver = asyncio.create_task(receive_all())

        async def send(k: int) -> bool:
            if done.is_set():
                return False
            units_by_seq.send(k + 1)
            await call.write(worker_pb.SessionRequest(unit=worker_pb.Unit(seq=k + 1, pcm=pcms[k])))
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

    async def _receive(self, call: Any, units_by_seq: UnitLedger, ended: list[int]) -> None:
        """The worker's results into the ledger, until its end (the reason into `ended`)."""
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
                engine_ms(timings),
                timings.wall_clock_ms,
            )


async def _granted(acquire: Any) -> Any:
    """The lease an Acquire stream grants, after any queued replies."""
    lease = None
    async for response in acquire:
        if response.WhichOneof("kind") == "lease":
            lease = response.lease
            break
        if response.WhichOneof("kind") != "queued":
            raise RuntimeError(f"acquire: {response.WhichOneof('kind')}")
    if lease is None:
        raise RuntimeError("acquire: ended without a lease")
    return lease
