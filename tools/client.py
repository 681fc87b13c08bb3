"""A real Realtime client: streams units over WebSocket and records what comes back.

Used by `omnifabric probe` and the load measurements; speaks either dialect.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed
from websockets.typing import Subprotocol

SILENCE_UNIT = np.zeros(16000, dtype=np.float32)


def pcm_b64(samples: np.ndarray) -> str:
    """Samples as the public protocol carries them: float32 little-endian, base64."""
    return base64.b64encode(samples.astype("<f4").tobytes()).decode()


@dataclass
class UnitRecord:
    """One unit as the client saw it."""

    seq: int
    sent_at: float
    received_at: float | None = None
    kind: str = ""  # listen | speak | dropped
    text: str = ""
    audio_samples: int = 0
    end_of_turn: bool = False
    kv_cache_length: int = 0
    prefill_ms: float = 0.0
    generate_ms: float = 0.0
    wall_clock_ms: float = 0.0

    @property
    def rtt_ms(self) -> float | None:
        if self.received_at is None:
            return None
        return (self.received_at - self.sent_at) * 1000.0

    @property
    def overhead_ms(self) -> float | None:
        """Client send -> client receive minus the engine's compute (prefill + generate)."""
        rtt = self.rtt_ms
        return None if rtt is None else rtt - self.prefill_ms - self.generate_ms


@dataclass
class SessionReport:
    """Everything one session produced."""

    events: list[dict[str, Any]] = field(default_factory=list)
    units: dict[int, UnitRecord] = field(default_factory=dict)
    audio: list[np.ndarray] = field(default_factory=list)
    closed_reason: str | None = None
    error: dict[str, Any] | None = None
    session_id: str = ""
    queue_wait_s: float = 0.0

    @property
    def reply_audio(self) -> np.ndarray:
        return np.concatenate(self.audio) if self.audio else np.zeros(0, np.float32)

    def reply_done(self) -> bool:
        """The model spoke and its turn has ended (end_of_turn, or a listen after speech)."""
        spoke = False
        for unit in sorted(self.units.values(), key=lambda u: u.seq):
            if unit.kind == "speak":
                spoke = True
                if unit.end_of_turn:
                    return True
            elif unit.kind == "listen" and spoke:
                return True
        return False

    def lost_units(self) -> list[int]:
        """Units with neither a result nor a counted drop."""
        return [u.seq for u in self.units.values() if u.kind == ""]


def _ev_type(event: dict[str, Any]) -> str:
    if event.get("type") == "response.output.delta":
        return f"delta.{event.get('kind')}"
    return str(event.get("type"))


async def run_session(
    url: str,
    units: list[np.ndarray],
    *,
    pace_s: float = 1.0,
    dialect: str = "current",
    system_prompt: str = "You are a helpful assistant.",
    api_key: str | None = None,
    frames: list[list[bytes]] | None = None,
    on_event: Callable[[dict[str, Any], SessionReport], object] | None = None,
    close_reason: str = "user_stop",
    settle_s: float = 5.0,
    init_extra: dict[str, Any] | None = None,
    unit_extra: list[dict[str, Any]] | None = None,
    reply_tail_s: int = 0,
) -> SessionReport:
    """Run one full-duplex session: queue, init, units at `pace_s`, close.

    After the units, up to `reply_tail_s` silent units more while the model's reply has not
    ended (so the whole answer is heard).

    `pace_s` = 0 sends each unit once the previous one is answered (lockstep).
    `on_event(event, report)` is called for every server event (e.g. to print it).
    `init_extra` adds fields to the init body (`payload` / `session`: config, voice...),
    `unit_extra[i]` to unit i's append body (force_listen, max_slice_nums).
    """
    report = SessionReport()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    t0 = time.monotonic()
    async with connect(
        url,
        subprotocols=[Subprotocol("map.realtime")],
        additional_headers=headers,
        compression=None,
        max_size=None,
        open_timeout=30,
    ) as ws:

        async def next_event() -> dict[str, Any]:
            event = json.loads(await ws.recv())
            report.events.append(event)
            if on_event:
                on_event(event, report)
            return event

        while True:
            event = await next_event()
            if event["type"] == "session.queue_done":
                report.queue_wait_s = time.monotonic() - t0
                break
            if event["type"] == "error":
                report.error = event["error"]
                return report
        if dialect == "first":
            session = {"instructions": system_prompt, **(init_extra or {})}
            await ws.send(json.dumps({"type": "session.update", "session": session}))
        else:
            payload = {"system_prompt": system_prompt, **(init_extra or {})}
            await ws.send(json.dumps({"type": "session.init", "payload": payload}))
        event = await next_event()
        if event["type"] != "session.created":
            report.error = event.get("error", {"code": "unexpected", "message": event["type"]})
            return report
        report.session_id = event.get("session_id", "")
        done = asyncio.Event()

        async def receive() -> None:
            try:
                while True:
                    event = await next_event()
                    _record(event, report, dialect)
                    if event["type"] == "session.closed":
                        report.closed_reason = event.get("reason")
                        done.set()
                        return
                    if event["type"] == "error":
                        report.error = event["error"]
            except Exception:
                done.set()

        receiver = asyncio.create_task(receive())
        start = time.monotonic()
        i = 0
        while not done.is_set():
            if i < len(units):
                unit = units[i]
            elif i < len(units) + reply_tail_s and not report.reply_done():
                unit = SILENCE_UNIT  # the reply is still coming: keep the line open
            else:
                break
            if pace_s > 0:
                delay = start + i * pace_s - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            elif i:
                # Lockstep: the next unit once the previous one is answered.
                await _answered(report.units[i], done, settle_s)
            if i >= len(units) and report.reply_done():
                break
            seq = i + 1
            body: dict[str, Any] = {"audio": pcm_b64(unit)}
            if frames and i < len(frames) and frames[i]:
                body["video_frames"] = [base64.b64encode(f).decode() for f in frames[i]]
            if unit_extra and i < len(unit_extra):
                body.update(unit_extra[i])
            report.units[seq] = UnitRecord(seq=seq, sent_at=time.monotonic())
            event = (
                {"type": "input_audio_buffer.append", **body}
                if dialect == "first"
                else {"type": "input.append", "input": body}
            )
            try:
                await ws.send(json.dumps(event))
            except ConnectionClosed:
                del report.units[seq]  # never sent
                break
            i += 1
        # Let the last results arrive, then close.
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline and any(u.kind == "" for u in report.units.values()):
            if done.is_set():
                break
            await asyncio.sleep(0.02)
        if not done.is_set():
            await ws.send(json.dumps({"type": "session.close", "reason": close_reason}))
            try:
                await asyncio.wait_for(done.wait(), 10)
            except TimeoutError:
                pass
        receiver.cancel()
    return report


async def _answered(unit: UnitRecord, done: asyncio.Event, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while unit.kind == "" and not done.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(0.002)


def _record(event: dict[str, Any], report: SessionReport, dialect: str) -> None:
    kind = _ev_type(event)
    metrics = event.get("metrics") or {}
    seq = metrics.get("seq")
    if (
        kind
        not in (
            "delta.listen",
            "delta.text",
            "delta.audio",
            "response.listen",
            "response.output_audio.delta",
        )
        or seq is None
    ):
        return
    unit = report.units.get(seq)
    if unit is None:
        return
    for dropped in metrics.get("dropped_seqs", ()):
        prev = report.units.get(dropped)
        if prev is not None and prev.kind == "":
            prev.kind = "dropped"
    if unit.received_at is None:
        unit.received_at = time.monotonic()
        unit.kv_cache_length = metrics.get("kv_cache_length", 0)
        unit.prefill_ms = metrics.get("prefill_ms", 0.0)
        unit.generate_ms = metrics.get("generate_ms", 0.0)
        unit.wall_clock_ms = metrics.get("wall_clock_ms", 0.0)
    if kind in ("delta.listen", "response.listen"):
        if unit.kind == "speak":  # the listen that closes a turn (current dialect)
            unit.end_of_turn = True
        elif unit.kind == "":
            unit.kind = "listen"
        unit.end_of_turn = unit.end_of_turn or bool(event.get("end_of_turn"))
        return
    unit.kind = "speak"
    if kind == "delta.text":
        unit.text += event.get("text", "")
    audio = event.get("audio")
    if kind == "response.output_audio.delta":
        unit.text += event.get("text", "")
        unit.end_of_turn = bool(event.get("end_of_turn"))
    if audio:
        pcm = np.frombuffer(base64.b64decode(audio), dtype="<f4")
        unit.audio_samples += pcm.size
        report.audio.append(pcm)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), nearest-rank; nan for no values."""
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values), q, method="nearest"))
