"""The paths of `omnifabric bench` through the edge: one session over the public WebSocket
protocol (fabric) or over the edge's RealtimeService (grpc-realtime), through edge,
scheduler and worker, its units into a UnitLedger."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import numpy as np
from websockets.typing import Subprotocol

from omnifabric.tools.client import engine_ms
from omnifabric.tools.perf.baselines import OwnConnections
from omnifabric.tools.perf.ledger import Samples, UnitLedger
from omnifabric.tools.perf.units import paced, settle

RESULT_TYPES = ("response.output.delta", "response.listen", "response.output_audio.delta")


async def fabric_session(
    url: str, delay_s: float, units: list[np.ndarray], frames: list[str], s: Samples
) -> None:
    """One session over the public protocol, opened after `delay_s`; figures into `s`."""
    from websockets.asyncio.client import connect

    units_by_seq = UnitLedger(s)
    closed = asyncio.Event()
    reason: list[str] = []
    await asyncio.sleep(delay_s)  # opens spread over --ramp-s
    t0 = time.monotonic()
    try:
        async with connect(
            url,
            subprotocols=[Subprotocol("map.realtime")],
            compression=None,
            max_size=None,
            open_timeout=60,
        ) as ws:
            while True:
                event = json.loads(await ws.recv())
                if event["type"] == "session.queue_done":
                    s.queue_wait.append((time.monotonic() - t0) * 1000.0)
                    break
                if event["type"] == "error":
                    raise RuntimeError(f"queue: {event['error'].get('code')}")
            await ws.send(json.dumps({"type": "session.init", "payload": {}}))
            event = json.loads(await ws.recv())
            if event["type"] != "session.created":
                raise RuntimeError(f"init: {event.get('error', event['type'])}")

            async def receive() -> None:
                try:
                    async for raw in ws:
                        if not _on_event(json.loads(raw), time.monotonic()):
                            return
                except Exception as exc:
                    s.errors.append(f"receive: {type(exc).__name__}")
                finally:
                    closed.set()

            def _on_event(event: dict[str, Any], now: float) -> bool:
                """Record one server event; False once the session is closed."""
                kind = event.get("type")
                if kind == "session.closed":
                    reason.append(str(event.get("reason")))
                    return False
                if kind == "error":
                    s.errors.append(str(event.get("error", {}).get("code")))
                    return True
                if kind not in RESULT_TYPES:
                    return True
                metrics = event.get("metrics") or {}
                units_by_seq.result(
                    int(metrics.get("seq") or 0),
                    metrics.get("dropped_seqs", ()),
                    now,
                    engine_ms(metrics),
                    metrics.get("wall_clock_ms"),
                )
                return True

            receiver = asyncio.create_task(receive())

            async def send(k: int) -> bool:
                if closed.is_set():
                    return False
                units_by_seq.send(k + 1)
                await ws.send(frames[k])
                return True

            await paced(len(units), send)
            await settle(units_by_seq.settled, closed, 5.0)
            if not closed.is_set():
                await ws.send(json.dumps({"type": "session.close", "reason": "user_stop"}))
                await asyncio.wait_for(closed.wait(), 15)
            receiver.cancel()
    except Exception as exc:  # the session is counted lost; the run goes on
        s.errors.append(f"{type(exc).__name__}: {exc}"[:120])
    units_by_seq.tally(closed_cleanly=reason == ["user_stop"])


class GrpcRealtime(OwnConnections):
    """The edge's RealtimeService (what an internal client that skips JSON gets): the same
    session as the fabric path in protobuf over gRPC, through edge, scheduler and worker,
    one connection per session."""

    async def session(
        self, delay_s: float, units: list[np.ndarray], pcms: list[bytes], s: Samples
    ) -> None:
        """One session over RealtimeService.Connect, opened after `delay_s`; figures into `s`."""
        import grpc

        from omnifabric.omni.realtime.v1 import common_pb2
        from omnifabric.omni.realtime.v1 import realtime_service_pb2 as rt_pb
        from omnifabric.omni.realtime.v1 import realtime_service_pb2_grpc as rt_grpc

        units_by_seq = UnitLedger(s)
        closed = asyncio.Event()
        reasons: list[int] = []
        await asyncio.sleep(delay_s)  # opens spread over --ramp-s
        t0 = time.monotonic()
        try:
            async with self.channel() as channel:
                call = rt_grpc.RealtimeServiceStub(channel).Connect()
                await call.write(
                    rt_pb.ConnectRequest(init=rt_pb.SessionInit(mode=common_pb2.MODE_AUDIO))
                )
                while True:
                    first = await call.read()
                    kind = "eof" if first is grpc.aio.EOF else first.WhichOneof("kind")
                    if kind == "queue_done":
                        s.queue_wait.append((time.monotonic() - t0) * 1000.0)
                    elif kind == "created":
                        break
                    elif kind not in ("queued", "queue_update"):
                        raise RuntimeError(f"init: {kind}")

                async def receive() -> None:
                    # read(), not `async for`: grpc.aio refuses both styles on one call.
                    try:
                        while (response := await call.read()) is not grpc.aio.EOF:
                            now = time.monotonic()
                            kind = response.WhichOneof("kind")
                            if kind == "closed":
                                reasons.append(response.closed.reason)
                                return
                            if kind == "error":
                                s.errors.append(response.error.code)
                            elif kind == "output":
                                out, timings = response.output, response.output.timings
                                units_by_seq.result(
                                    out.seq,
                                    out.dropped_seqs,
                                    now,
                                    engine_ms(timings),
                                    timings.wall_clock_ms,
                                )
                    except Exception as exc:
                        s.errors.append(f"receive: {type(exc).__name__}")
                    finally:
                        closed.set()

                receiver = asyncio.create_task(receive())

                async def send(k: int) -> bool:
                    if closed.is_set():
                        return False
                    units_by_seq.send(k + 1)
                    await call.write(rt_pb.ConnectRequest(append=rt_pb.InputAppend(audio=pcms[k])))
                    return True

                await paced(len(units), send)
                await settle(units_by_seq.settled, closed, 5.0)
                if not closed.is_set():
                    close = rt_pb.SessionCloseRequest(reason="user_stop")
                    await call.write(rt_pb.ConnectRequest(close=close))
                    await asyncio.wait_for(closed.wait(), 15)
                receiver.cancel()
        except Exception as exc:  # the session is counted lost; the run goes on
            s.errors.append(f"{type(exc).__name__}: {exc}"[:120])
        units_by_seq.tally(closed_cleanly=reasons == [common_pb2.CLOSE_REASON_USER_STOP])
