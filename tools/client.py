"""A real Realtime client: streams units over WebSocket and records what comes back.

Used by `omnifabric probe` and the load measurements; speaks either dialect.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake
from websockets.typing import Subprotocol

SILENCE_UNIT = np.zeros(16000, dtype=np.float32)


def pcm_b64(samples: np.ndarray) -> str:
    """Samples as the public protocol carries them: float32 little-endian, base64."""
    return base64.b64encode(samples.astype("<f4").tobytes()).decode()


#: A unit's engine time (the rest of its round trip is the fabric's): its prefill and
#: generate, and its waits for the engine to finish the session's earlier unit: that unit's
#: compute (engine_busy_ms), then its deferred finalize (the engine still making the speech
#: that went out with it).
ENGINE_TIMINGS = ("prefill_ms", "generate_ms", "engine_busy_ms", "finalize_wait_ms")


def engine_ms(timings: Any) -> float:
    """A unit's engine time (ENGINE_TIMINGS) from its timings: the public events' `metrics`
    (a dict; missing fields count 0) or a protobuf UnitTimings."""
    if isinstance(timings, Mapping):
        return float(sum(timings.get(key) or 0.0 for key in ENGINE_TIMINGS))
    return float(sum(getattr(timings, key) for key in ENGINE_TIMINGS))


@dataclass
class UnitRecord:
    """One unit as the client saw it."""

    seq: int
    sent_at: float
    received_at: float | None = None
    kind: str = ""  # listen | speak | dropped
    text: str = ""
    audio_samples: int = 0
    audio_at: float | None = None
    """When its first audio arrived: with its result, or later where the worker sent the
    start of a reply its finalize began after the unit listened (an early output, which
    carries the unit's seq)."""
    end_of_turn: bool = False
    kv_cache_length: int = 0
    prefill_ms: float = 0.0
    generate_ms: float = 0.0
    engine_busy_ms: float = 0.0
    finalize_wait_ms: float = 0.0
    wall_clock_ms: float = 0.0

    @property
    def rtt_ms(self) -> float | None:
        if self.received_at is None:
            return None
        return (self.received_at - self.sent_at) * 1000.0

    @property
    def engine_ms(self) -> float:
        """The engine's time in this unit's round trip (ENGINE_TIMINGS)."""
        return self.prefill_ms + self.generate_ms + self.engine_busy_ms + self.finalize_wait_ms

    @property
    def overhead_ms(self) -> float | None:
        """Client send -> client receive minus the engine's time (engine_ms)."""
        rtt = self.rtt_ms
        return None if rtt is None else rtt - self.engine_ms


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
    resumes_s: list[float] = field(default_factory=list)
    """Per resume: seconds from the lost connection to session.resumed."""

    @property
    def reply_audio(self) -> np.ndarray:
        return np.concatenate(self.audio) if self.audio else np.zeros(0, np.float32)

    def reply_done(self, input_units: int = 0) -> bool:
        """The model's last reply has ended: it spoke, and its latest run of speech ended
        (end_of_turn, or a listen after speech). With `input_units` (the units of real input;
        silence is sent after them), a reply that ended within the input counts only once
        two units after the input were answered with listening: a last question's reply may
        still be on its way."""
        ended_at: int | None = None  # the seq that ended the latest run of speech
        speaking = False
        quiet_after_input = 0
        for unit in sorted(self.units.values(), key=lambda u: u.seq):
            if unit.kind == "speak":
                speaking, ended_at = True, None
                if unit.end_of_turn:
                    speaking, ended_at = False, unit.seq
            elif unit.kind == "listen":
                if speaking:
                    speaking, ended_at = False, unit.seq
                if unit.seq > input_units:
                    quiet_after_input += 1
        if ended_at is None:
            return False
        return ended_at > input_units or quiet_after_input >= QUIET_UNITS_AFTER_INPUT

    def lost_units(self) -> list[int]:
        """Units with neither a result nor a counted drop."""
        return [u.seq for u in self.units.values() if u.kind == ""]

    def event_seqs(self) -> list[int]:
        """The `seq` of every session event received, in order (resumable sessions)."""
        return [e["seq"] for e in self.events if isinstance(e.get("seq"), int)]

    def seq_faults(self) -> tuple[int, int]:
        """(events missed, events received twice) by their seq: (0, 0) when the session's
        events came complete and once each, across resumes."""
        seqs = self.event_seqs()
        if not seqs:
            return 0, 0
        repeated = len(seqs) - len(set(seqs))
        missed = len(set(range(1, max(seqs) + 1)) - set(seqs))
        return missed, repeated


def _ev_type(event: dict[str, Any]) -> str:
    if event.get("type") == "response.output.delta":
        return f"delta.{event.get('kind')}"
    return str(event.get("type"))


#: Reconnect delays after a lost connection (then the last one, until the window ends).
RECONNECT_DELAYS_S = (0.0, 0.2, 0.5, 1.0, 2.0)
#: Listening units answered after the input that end the wait for a last reply, when the
#: latest reply ended within the input (a last question may still be heard then).
QUIET_UNITS_AFTER_INPUT = 2


class _Link:
    """The session's current connection, replaced when it drops and the session resumes."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.up = asyncio.Event()
        self.up.set()
        self.resend_from: int | None = None
        """Set by a resume: the next unit to send (the session got the ones before)."""


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
    resume: bool = True,
    drop_after: int | None = None,
    resume_url: str | None = None,
    at_s: list[float] | None = None,
) -> SessionReport:
    """Run one full-duplex session: queue, init, units at `pace_s`, close.

    After the units, up to `reply_tail_s` silent units more while the model's reply has not
    ended (so the whole answer is heard).

    `pace_s` = 0 sends each unit once the previous one is answered (lockstep).
    `on_event(event, report)` is called for every server event (e.g. to print it).
    `init_extra` adds fields to the init body (`payload` / `session`: config, voice...),
    `unit_extra[i]` to unit i's append body (force_listen, max_slice_nums).
    A connection lost without a close is resumed (`resume`, when the server gave a
    resume token) with backoff for the session's resume window; the units the session did
    not get are sent again (at `resume_url` when given: another edge). `drop_after` cuts
    the connection once after that unit (to measure resuming). `at_s[i]`: when input unit i
    goes, seconds after the first (units of any length sent as their audio would be spoken;
    the silent units after them follow at `pace_s`), instead of `i * pace_s`.
    """
    run = _SessionRun(
        url,
        units,
        _Options(
            pace_s=pace_s,
            dialect=dialect,
            system_prompt=system_prompt,
            api_key=api_key,
            frames=frames,
            on_event=on_event,
            close_reason=close_reason,
            settle_s=settle_s,
            init_extra=init_extra,
            unit_extra=unit_extra,
            reply_tail_s=reply_tail_s,
            resume=resume,
            drop_after=drop_after,
            resume_url=resume_url,
            at_s=at_s,
        ),
    )
    return await run.run()


@dataclass
class _Options:
    """run_session's keyword arguments (see there)."""

    pace_s: float
    dialect: str
    system_prompt: str
    api_key: str | None
    frames: list[list[bytes]] | None
    on_event: Callable[[dict[str, Any], SessionReport], object] | None
    close_reason: str
    settle_s: float
    init_extra: dict[str, Any] | None
    unit_extra: list[dict[str, Any]] | None
    reply_tail_s: int
    resume: bool
    drop_after: int | None
    resume_url: str | None
    at_s: list[float] | None


class _SessionRun:
    """One run_session: its connection (resumed when lost), its report, its steps."""

    def __init__(self, url: str, units: list[np.ndarray], options: _Options) -> None:
        self.url = url
        self.units = units
        self.o = options
        self.report = SessionReport()
        self.headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else None
        self.link: _Link | None = None
        self.token: str | None = None
        self.window_s = 0.0
        self.done = asyncio.Event()

    def dial(self, target: str) -> Any:
        return connect(
            target,
            subprotocols=[Subprotocol("map.realtime")],
            additional_headers=self.headers,
            compression=None,
            max_size=None,
            open_timeout=30,
        )

    @property
    def ws(self) -> Any:
        assert self.link is not None
        return self.link.ws

    async def next_event(self, ws: Any = None) -> dict[str, Any]:
        event = json.loads(await (ws or self.ws).recv())
        self.report.events.append(event)
        if self.o.on_event:
            self.o.on_event(event, self.report)
        return event

    async def run(self) -> SessionReport:
        t0 = time.monotonic()
        async with self.dial(self.url) as first_ws:
            self.link = _Link(first_ws)
            if not await self._open(t0):
                return self.report
            receiver = asyncio.create_task(self._receive())
            await self._send_units()
            await self._settle_and_close()
            receiver.cancel()
            if self.link.ws is not first_ws:
                await self.link.ws.close()
        return self.report

    async def _open(self, t0: float) -> bool:
        """Wait out the queue, then init the session; False (the error in the report) when
        the server refused it."""
        report = self.report
        while True:
            event = await self.next_event()
            if event["type"] == "session.queue_done":
                report.queue_wait_s = time.monotonic() - t0
                break
            if event["type"] == "error":
                report.error = event["error"]
                return False
        if self.o.dialect == "first":
            session = {"instructions": self.o.system_prompt, **(self.o.init_extra or {})}
            await self.ws.send(json.dumps({"type": "session.update", "session": session}))
        else:
            payload = {"system_prompt": self.o.system_prompt, **(self.o.init_extra or {})}
            await self.ws.send(json.dumps({"type": "session.init", "payload": payload}))
        event = await self.next_event()
        if event["type"] != "session.created":
            report.error = event.get("error", {"code": "unexpected", "message": event["type"]})
            return False
        report.session_id = event.get("session_id", "")
        self.token = event.get("resume_token") if self.o.resume else None
        self.window_s = float(event.get("resume_window_s") or 0)
        return True

    async def _reconnect(self) -> bool:
        """Resume the session on a new connection; False when it cannot be."""
        assert self.link is not None
        report = self.report
        lost = time.monotonic()
        seqs = report.event_seqs()
        base = self.o.resume_url or self.url
        sep = "&" if "?" in base else "?"
        target = f"{base}{sep}resume_token={self.token}&last_seq={max(seqs) if seqs else 0}"
        attempt = 0
        while time.monotonic() - lost < self.window_s:
            await asyncio.sleep(RECONNECT_DELAYS_S[min(attempt, len(RECONNECT_DELAYS_S) - 1)])
            attempt += 1
            try:
                ws = await self.dial(target).__aenter__()
            except (OSError, TimeoutError, InvalidHandshake):
                continue
            try:
                answer = await self.next_event(ws)
            except ConnectionClosed:
                continue
            if answer["type"] == "session.resumed":
                # Units go on the new connection only from here.
                report.resumes_s.append(time.monotonic() - lost)
                self.link.resend_from = int(answer.get("last_input_seq", 0))
                self.link.ws = ws
                return True
            report.error = answer.get("error") or {"code": "unexpected"}
            return False
        report.error = {"code": "resume_expired", "message": "could not reconnect in time"}
        return False

    async def _receive(self) -> None:
        assert self.link is not None
        link, report = self.link, self.report
        try:
            while True:
                try:
                    event = await self.next_event()
                except ConnectionClosed as closed:
                    if self.done.is_set() or not self.token or closed.rcvd is not None:
                        raise
                    link.up.clear()
                    if not await self._reconnect():
                        raise
                    link.up.set()
                    continue
                _record(event, report, self.o.dialect)
                if event["type"] == "session.closed":
                    report.closed_reason = event.get("reason")
                    self.done.set()
                    return
                if event["type"] == "error":
                    report.error = event["error"]
        except Exception:
            self.done.set()
            link.up.set()

    def _next_unit(self, i: int) -> np.ndarray | None:
        """Unit i: the input's, silence while a reply is still coming after it, or None
        (nothing more to send)."""
        count = len(self.units)
        if i < count:
            return self.units[i]
        if i < count + self.o.reply_tail_s and not self.report.reply_done(count):
            return SILENCE_UNIT  # the reply is still coming: keep the line open
        return None

    async def _send_units(self) -> None:
        assert self.link is not None
        link, report, o = self.link, self.report, self.o
        start = time.monotonic()
        i = 0
        dropped_once = False
        while not self.done.is_set():
            await link.up.wait()
            if self.done.is_set():
                break
            if link.resend_from is not None:
                # Resumed: the session got units up to resend_from; the rest go again.
                i, link.resend_from = link.resend_from, None
                for seq in [s for s in report.units if s > i]:
                    del report.units[seq]
            unit = self._next_unit(i)
            if unit is None:
                break
            await self._pace(i, start)
            if i >= len(self.units) and report.reply_done(len(self.units)):
                break
            if not link.up.is_set() or link.resend_from is not None:
                continue  # resumed (or resuming) meanwhile: start again from what it says
            seq = i + 1
            if not await self._send(i, seq, unit):
                if not self.token:
                    break
                link.up.clear()  # the receiver resumes the session (or gives up)
                await asyncio.sleep(0.05)
                continue
            i += 1
            if o.drop_after is not None and seq == o.drop_after and not dropped_once:
                dropped_once = True
                link.ws.transport.abort()  # a network that went away: no close frame

    async def _pace(self, i: int, start: float) -> None:
        """Wait for unit i's time (pace_s), or for unit i's answer (lockstep)."""
        if self.o.pace_s > 0:
            at, due = self.o.at_s, i * self.o.pace_s
            if at:
                due = at[i] if i < len(at) else at[-1] + (i - len(at) + 1) * self.o.pace_s
            delay = start + due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        elif i and i in self.report.units:
            # Lockstep: the next unit once the previous one is answered.
            await _answered(self.report.units[i], self.done, self.o.settle_s)

    async def _send(self, i: int, seq: int, unit: np.ndarray) -> bool:
        """Sends unit i as `seq`; False when the connection was closed (not sent)."""
        o = self.o
        body: dict[str, Any] = {"audio": pcm_b64(unit)}
        if o.frames and i < len(o.frames) and o.frames[i]:
            body["video_frames"] = [base64.b64encode(f).decode() for f in o.frames[i]]
        if o.unit_extra and i < len(o.unit_extra):
            body.update(o.unit_extra[i])
        self.report.units[seq] = UnitRecord(seq=seq, sent_at=time.monotonic())
        event = (
            {"type": "input_audio_buffer.append", **body}
            if o.dialect == "first"
            else {"type": "input.append", "input": body}
        )
        try:
            await self.ws.send(json.dumps(event))
        except ConnectionClosed:
            del self.report.units[seq]  # never sent
            return False
        return True

    async def _settle_and_close(self) -> None:
        """Let the last results arrive, then close."""
        deadline = time.monotonic() + self.o.settle_s
        while time.monotonic() < deadline and any(u.kind == "" for u in self.report.units.values()):
            if self.done.is_set():
                break
            await asyncio.sleep(0.02)
        if not self.done.is_set():
            try:
                close = {"type": "session.close", "reason": self.o.close_reason}
                await self.ws.send(json.dumps(close))
                await asyncio.wait_for(self.done.wait(), 10)
            except (TimeoutError, ConnectionClosed):
                pass


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
        unit.engine_busy_ms = metrics.get("engine_busy_ms", 0.0)
        unit.finalize_wait_ms = metrics.get("finalize_wait_ms", 0.0)
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
        if unit.audio_at is None:
            unit.audio_at = time.monotonic()
        unit.audio_samples += pcm.size
        report.audio.append(pcm)
